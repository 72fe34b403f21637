"""`python -m kvserve ...` does what `kvserve ...` does."""

from kvserve.entrypoints.cli import main

main()

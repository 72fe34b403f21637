"""`python tools/routers ...` from the repository root: Python puts this folder first on sys.path."""

from routers import main

main()

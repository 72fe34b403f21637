"""`python tools/peers ...` from the repository root: Python puts this folder first on sys.path."""

from peers import main

main()

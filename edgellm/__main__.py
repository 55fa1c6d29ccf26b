"""`python -m edgellm ...` is the `edgellm` command."""

from edgellm.entrypoints.cli import main

main()

"""`python -m eaglenest.cli`: the same as the `eaglenest` command."""

from eaglenest.cli.main import main

main()

"""The `eaglenest` command line."""

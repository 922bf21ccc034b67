"""Thin DVC entry points: read params.yaml, call the library, write outs and metrics."""

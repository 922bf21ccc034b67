"""Versions that decide the bytes `extract` writes. This file is a DVC dependency of `extract`:
changing it re-extracts every part, and nothing else in the code does.

CAPTURE_VERSIONS: bump a backend's number when a change alters what it captures (part of the
extractor fingerprint). STORE_SCHEMA_VERSION: bump when the store layout changes (readers refuse
other versions). Changes that cannot alter the bytes (logging, speed) leave both alone."""

CAPTURE_VERSIONS = {"hf": 1, "sglang": 1, "vllm": 1}
STORE_SCHEMA_VERSION = 2

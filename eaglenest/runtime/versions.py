"""Versions that decide the bytes `extract` writes. This file is a DVC dependency of `extract`:
changing it re-extracts every part, and nothing else in the code does.

CAPTURE_VERSIONS: bump a backend's number when a change alters what it captures (part of the
extractor fingerprint). STORE_SCHEMA_VERSION: bump when the store layout changes (readers refuse
other versions). Changes that cannot alter the bytes (logging, speed) leave both alone, and so does a
layout change every reader takes from the store's own metadata: shard files named c.<piece>.0 (one
directory per array) instead of c/<piece>/0 came without a bump, so existing stores stay valid and
are not re-extracted; zarr reads either from each array's zarr.json."""

CAPTURE_VERSIONS = {"hf": 1, "sglang": 1, "vllm": 1}
STORE_SCHEMA_VERSION = 2

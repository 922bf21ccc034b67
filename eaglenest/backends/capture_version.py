"""Capture-code versions, part of the extractor fingerprint and a DVC dependency of `extract`.
Bump a backend's number when a change alters the bytes it captures: every part re-extracts.
Changes that cannot alter the bytes (logging, speed) leave it alone and re-extract nothing."""
CAPTURE_VERSIONS = {"hf": 1, "sglang": 1}

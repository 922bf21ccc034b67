"""Extraction (docs/design.md: Extraction, Store, Gate): pieces planned over a part (`plan`), a
crash-safe work dir and its lock (`work_dir`), the pipelined loop and its writers (`loop`), the
backends that compute states (`backends/`), the extractor fingerprint (`fingerprint`) and the
validation gate (`gate`)."""

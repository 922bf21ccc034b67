"""Writing, hashing and naming files: writes by rename, digests, sizes, plain names and strict
YAML, the check of the DVC cache behind the outputs."""

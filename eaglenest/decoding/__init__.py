"""Decoding with the target: batched generation (`batch_decode`, CUDA-graphed `static_decode`,
`kv_cache`) and speculative decoding with a drafter (`speculative`, `batched_speculative`)."""

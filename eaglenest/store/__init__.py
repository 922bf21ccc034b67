"""The hidden-state store (docs/design.md: Store): the Zarr v3 layout and its reader
(`hidden_store`), how states are kept (`states`: bf16 or fp8, `bf16`), and the shard writer
(`shard_writer`: encoding and durable writes, byte-identical to zarr's)."""

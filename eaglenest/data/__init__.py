"""Training data (docs/design.md: Tokenize and generate, Pack): conversations files, the chat
template and loss mask (`chat`), self-distillation (`generate`), the draft vocabulary (`vocab`),
packing (`pack`) and reading packed shards (`packed`)."""

"""The megatron-core training backend (train.backend: megatron): TP / EP / sequence parallel."""

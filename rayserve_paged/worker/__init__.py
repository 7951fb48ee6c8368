"""One tensor-parallel rank: model shard, KV cache tensors, the step's execution."""

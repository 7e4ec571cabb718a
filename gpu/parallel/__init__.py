"""Tensor parallelism inside the model: one rank's shard of the weights and its collectives."""

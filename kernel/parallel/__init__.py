"""Tensor parallelism as the engine runs it: rank 0 starts, feeds and stops the worker ranks."""

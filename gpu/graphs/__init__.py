"""Static-shape execution: the graph runner and its static-buffer registry.

`static_buffers.StaticBuffers` holds every buffer a captured graph reads, each with
the sentinel its padding rows take; `runner.GraphRunner` picks a bucket for a batch,
stages the batch into those buffers and replays a CUDA graph (mode `cuda`) or runs
the model on the same static buffers (mode `emulate`, CPU CI).
"""

"""Plain-torch kernels of the hybrid models' linear layers (gated delta rule, short conv).

CPU first: no custom extensions. Optional fused kernels (flash-linear-attention,
causal-conv1d) may be added later behind the same functions; nothing here needs them.
"""

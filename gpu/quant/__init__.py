"""Weight-only quantized linears (int8, 4-bit) for the bandwidth-bound decode path."""

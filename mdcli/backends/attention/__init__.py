"""Attention cores for masked forest forwards: batched products, gathered (sparse) and shared-prefix plans, the CUDA backend choice."""

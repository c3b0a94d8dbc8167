"""Tensor parallelism: which rank holds which slice, the collectives, and the process group of ranks."""

"""Kernels images (publish, look up, verify, proofs attached) and `inject`."""

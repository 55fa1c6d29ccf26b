"""Kernels (Triton) and their torch/numpy reference twins."""

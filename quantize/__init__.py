"""Quantization (RTN, AWQ, GPTQ), checkpoints and exporters."""

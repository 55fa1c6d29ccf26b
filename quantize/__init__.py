"""Quantization (RTN, AWQ, GPTQ), checkpoints and exporters.

from edgellm.quantize import quantize, QuantizeOptions
report = quantize("smollm2-135m", "out/smol-awq", QuantizeOptions(method="awq"))
"""

from edgellm.quantize.pipeline import QuantizeOptions, quantize

__all__ = ["QuantizeOptions", "quantize"]

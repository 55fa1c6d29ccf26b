"""Quantization (RTN, AWQ, GPTQ), checkpoints and exporters.

from edgellm.quantize import quantize, QuantizeOptions
report = quantize("smollm2-135m", "out/smol-awq", QuantizeOptions(method="awq"))
"""

__all__ = ["QuantizeOptions", "quantize"]


def __getattr__(name: str):
    if name in __all__:
        from edgellm.quantize import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)

"""Sampling: `SamplingParams` and the one sampler every backend's logits go through."""

"""Smaller and better models from a float teacher: structured pruning (`prune`), with
distillation to follow (issue 18)."""

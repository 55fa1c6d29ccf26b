"""Smaller and better models from a float teacher: structured pruning (`prune`) and
distillation (`distill`: a pruned or INT4 student learns the teacher's logits)."""

from edgellm.distill.pipeline import DistillOptions, DistillReport, distill
from edgellm.distill.prune import PruneOptions, prune

__all__ = ["DistillOptions", "DistillReport", "PruneOptions", "distill", "prune"]

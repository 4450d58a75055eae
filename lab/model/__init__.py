"""The model (``gpt``: the GPT, one file top to bottom) and the plan it declares for the parallel transforms."""

from lab.model.gpt import (ARCHS, GPT, PARAMETRIZATIONS, apply_rope, rope_tables, validate, validate_split,
                           width_ratio)
from lab.model.plan import ColumnSplit, ParallelPlan, TensorPlan, plan_of

__all__ = ["ARCHS", "GPT", "PARAMETRIZATIONS", "ColumnSplit", "ParallelPlan", "TensorPlan", "apply_rope", "plan_of",
           "rope_tables", "validate", "validate_split", "width_ratio"]

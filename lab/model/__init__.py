"""The model (``gpt``: the GPT, one file top to bottom) and the plan it declares for the parallel transforms."""

from lab.model.gpt import (ARCHS, GPT, PARAMETRIZATIONS, MoE, apply_rope, balance_loss, rope_tables, router_meters,
                           validate, width_ratio)
from lab.model.plan import ColumnSplit, ParallelPlan, TensorPlan, plan_of

__all__ = ["ARCHS", "GPT", "PARAMETRIZATIONS", "ColumnSplit", "MoE", "ParallelPlan", "TensorPlan", "apply_rope",
           "balance_loss", "plan_of", "rope_tables", "router_meters", "validate", "width_ratio"]

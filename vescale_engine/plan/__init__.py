"""The planning tier, torch-free: block sizes (granularity), the RaggedShard layout planner
(planner), whole-model plans from shapes files (model_plan), the optimizers' torch-free defaults
(optim_spec) and one step's memory and traffic replayed from the plans (capacity, `vescale plan
--memory`). Owns the arithmetic of layouts; must not know torch, devices, process groups or
modules: `vescale plan` runs without torch (tests/engine/test_package.py checks it).
"""
from .granularity import Granularity, parse_granularity
from .planner import PlanError, TensorSpec, check_plan, plan_unit

__all__ = ["Granularity", "parse_granularity", "TensorSpec", "plan_unit", "check_plan", "PlanError"]

"""CPU planning for CP prefill: page-aligned zigzag split and padding provenance.

Deterministic and communication-free; see ``docs/plan.md``.
"""

from .materialize import GatherLayout, MaterializeDescriptors, materialize_descriptors
from .plan import ROW_COMPUTE_PAD, ROW_STATIC_PAD, ROW_VALID, CPPlan, RankPlan, plan_prefill
from .slots import slots_for_positions

__all__ = [
    "plan_prefill",
    "CPPlan",
    "RankPlan",
    "ROW_VALID",
    "ROW_COMPUTE_PAD",
    "ROW_STATIC_PAD",
    "materialize_descriptors",
    "GatherLayout",
    "MaterializeDescriptors",
    "slots_for_positions",
]

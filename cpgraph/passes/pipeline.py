"""The default pass pipeline, in order.

Rewrite passes (what CP needs, then two that share work between FP8
projections and the norms feeding them), then lowering (expose collectives to Inductor), then cleanup,
then lint.  Kept as data so a user can see,
reorder or disable passes by name (``CPConfig.disabled_passes``).
"""

from __future__ import annotations

from .cleanup import eliminate_dead_code, sort_topologically
from .compact_moe import compact_moe_rows
from .fuse_norm_quant import fuse_norm_into_quantization
from .gather_outputs import gather_output_rows
from .index_cache import reuse_shared_topk
from .invariant_kernels import use_invariant_kernels
from .kv_in_place import read_kv_in_place
from .lint import reject_host_syncs
from .lower_collectives import lower_cp_collectives
from .share_quant import share_activation_quantization
from .shard_kv import materialize_kv_by_owner


def default_passes():
    return [
        ("reuse_shared_topk", reuse_shared_topk),
        ("materialize_kv_by_owner", materialize_kv_by_owner),
        ("read_kv_in_place", read_kv_in_place),
        ("compact_moe_rows", compact_moe_rows),
        ("gather_output_rows", gather_output_rows),
        ("use_invariant_kernels", use_invariant_kernels),  # only with CPConfig(deterministic=True)
        ("share_activation_quantization", share_activation_quantization),  # FP8 projections reading one x
        ("fuse_norm_into_quantization", fuse_norm_into_quantization),  # ... quantised by the norm producing x
        ("lower_cp_collectives", lower_cp_collectives),
        ("eliminate_dead_code", eliminate_dead_code),
        ("sort_topologically", sort_topologically),
        ("reject_host_syncs", reject_host_syncs),
    ]

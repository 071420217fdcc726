"""Per-rank memory of a CP prefill, from a model config alone: weights, KV cache, activation peak.

Why a plan: the question "how many GPUs of which size does a 128K-token
prefill of this checkpoint need at CP 8 / EP 8" should be answered before
renting them, from ``config.json`` and arithmetic.  Everything here is a
pure function of a config object with the fields of
:class:`cpgraph.models.config.DSAConfig` (duck-typed: this package sits
below ``cpgraph.models`` and never imports it) and a few integers.

Three parts, each documented with its model in ``docs/launch.md``:

* **weights** by part, per rank: every rank of a CP group holds the whole
  model (CP splits tokens, not weights) except the routed experts, which
  expert parallelism splits ``E / ep`` per rank.  With the model dtype this
  is exactly what ``cpgraph.models.build_model`` allocates (tested against
  ``estimate_model_bytes``); ``fp8`` counts every projection matrix as e4m3
  plus one fp32 scale per 128x128 block (the DeepSeek checkpoint format).
* **KV**: MLA records (656 B/token FP8, ``(kv_lora + rope) x dtype`` dense)
  in every layer; index-K (132 B/token FP8 at D = 128, ``D x dtype`` dense)
  only in layers that run their own indexer (IndexCache).  Owner-sharded:
  a rank stores the pages it owns under the zigzag split, page-rounded.
* **activations**: the largest transient of one forward of ``rows`` rows
  per rank against ``keys`` full-view keys, as a set of phases (what is
  live at once in each), a model of cpgraph's GPU path -- an estimate to
  compare with a measurement (``benchmarks/memory_check.py``), not a bound.

Modules, by concern (this package re-exports their names, the private ones
tests and benchmarks use included):

* ``formats``: byte sizes of the dtypes and cache formats, argument checks;
* ``weights``, ``kv``: the weight and KV-cache arithmetic;
* ``tape``: the allocation replay (``_Tape``) the activations are booked on;
* ``op_bookings``, ``indexer``, ``attention``, ``mlp``: one forward's tensors,
  op by op and layer half by layer half;
* ``expert_providers``, ``experts``: which routed-experts implementation is
  booked, and its buffers;
* ``activations``: the phases of one forward, worst layer of each kind;
* ``plan``, ``render``: :class:`MemoryPlan`, :func:`plan_memory` and the table.
"""

from __future__ import annotations

from .activations import activation_phases
from .attention import _attention_layer
from .expert_providers import EXPERTS_PROVIDERS, _check_experts_provider, default_experts_provider
from .experts import DEEP_GEMM_ALIGN, TMA_ALIGN_FP32, _dispatch_plan, _routed_experts, experts_bytes
from .formats import (
    DEFAULT_MAX_LOGITS_BYTES,
    DTYPE_BYTES,
    FP8_SCALE_BLOCK,
    KV_FORMATS,
    MLA_FP8_RECORD_BYTES,
    _act_bytes,
    _check_int,
)
from .indexer import _chunked_topk, _hadamard, _indexer, _select_scratch_columns
from .kv import kv_bytes_per_token, owned_pages
from .mlp import _mlp_layer, _swiglu
from .op_bookings import _compose, _fp32_product, _rope, _split_fp32_products
from .plan import MemoryPlan, plan_memory
from .render import _UNITS, _unit, render_memory
from .tape import ALLOC_ROUND, _block, _Tape
from .weights import PARTS, _matrix, param_count, weight_bytes

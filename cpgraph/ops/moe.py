"""Routed experts of a MoE layer: ``cpgraph::moe_experts``.

Why an op: the routed experts are the only part of the model whose cost
depends on *which* rows go *where*.  Run densely (every expert on every row,
weights zero off the top-k) they cost ``E / top_k`` times the routed FLOPs;
a provider that dispatches rows to their experts and runs all experts as one
grouped GEMM does only the routed work.  As an op the model stays plain
torch (one node in the graph) and the device decides the implementation.

Contract (every provider computes the same function)::

    out[m] = sum_j  w[m, j] * down_e( silu(gate_e(x[m])) * up_e(x[m]) ),   e = ids[m, j]

for every row ``m < num_valid`` and every slot ``j`` with ``0 <= ids[m, j] < E``.
A row ``m >= num_valid`` contributes nothing and takes no expert work: its
output is an exact zero row.  An expert id outside ``[0, E)`` routes the
slot nowhere (same "no row" rule as the row ops; with ``CPGRAPH_DEBUG`` on
it raises instead).

``num_valid`` (int64 ``[1]``, on the device, or ``None`` = every row): the
number of real rows, which by the planner's row contract form a prefix of
the rows (``docs/contracts.md``: valid rows first, dummies at the tail; the
CP MoE pass keeps that true after it compacts).  The model derives it from
the row windows it already holds (a real row has a non-empty key window),
so dummy rows never reach an expert, with or without the pass.

Static shapes throughout: the dispatch buffer has capacity ``M * top_k``
rows whatever the routing (one expert may receive every row), so nothing
depends on data and the grouped provider is CUDA-graph capturable.  See
:func:`dispatch_plan` for the layout.

FP8 experts (block-quantized checkpoints kept in e4m3, ``weights="fp8"``):
``gate_up`` / ``down`` are float8_e4m3fn with fp32 block scales
``gate_up_scale [E, ceil(2I / bn), ceil(H / bk)]`` and ``down_scale [E,
ceil(H / bn), ceil(I / bk)]`` (each expert's ``weight_scale_inv``, stacked;
``I`` a multiple of ``bn`` so the gate and up halves never share a scale
row).  Then each projection is ``cpgraph::fp8_block_linear``'s function:
its input is quantised per row per ``bk`` values by the same recipe (the
expert input ``x``, then the SwiGLU output ``silu(gate) * up`` computed in
fp32 from the rounded ``gate`` / ``up``), the dequantised operands are
multiplied in fp32, and ``gate`` / ``up`` and each expert's output are
rounded to ``x``'s dtype before the fp32 weighted combine.  So FP8 and bf16
experts differ by the activation quantisation only (docs/ops/fp8_linear.md
gives the measured bound).

Implementations:

* reference (:func:`moe_experts_reference`): the dense form, exact in
  fp32 and trivially row-local; used on CPU and for bisecting;
* grouped (:func:`moe_experts_grouped`): sort the ``(row, slot)`` pairs by
  expert, gather rows, ``torch._grouped_mm`` for gate/up, SwiGLU, grouped
  down projection, weighted combine in fp32.  ``cpgraph.kernels.moe``
  registers it for CUDA with a Triton combine.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor
from .codecs import FP8
from .fp8_linear import ceil_div, dequantize_weight, quantize_activations
from .providers import select

_INDEX = (torch.int64, torch.int32)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------- checks
def _check_moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale=None, down_scale=None,
                       block_n=128, block_k=128) -> None:
    op = "moe_experts"
    check_tensor(op, "x", x, dtype=_FLOAT, ndim=2)
    m, h = x.shape
    check_tensor(op, "topk_ids", topk_ids, dtype=_INDEX, ndim=2, shape=(m, None))
    check_tensor(op, "topk_w", topk_w, dtype=torch.float32, shape=(m, topk_ids.shape[1]))
    fp8 = gate_up_scale is not None or down_scale is not None
    wdtype = FP8 if fp8 else x.dtype
    check_tensor(op, "gate_up", gate_up, dtype=wdtype, ndim=3, shape=(None, None, h))
    e, two_i, _ = gate_up.shape
    if isinstance(two_i, int) and two_i % 2:
        raise ValueError(f"cpgraph.moe_experts: argument 'gate_up' must be [E, 2*I, H], got {tuple(gate_up.shape)}")
    i = two_i // 2
    check_tensor(op, "down", down, dtype=wdtype, shape=(e, h, i))
    if fp8:
        if gate_up_scale is None or down_scale is None:
            raise ValueError("cpgraph.moe_experts: FP8 experts need both 'gate_up_scale' and 'down_scale'")
        for name, v in (("block_n", block_n), ("block_k", block_k)):
            if isinstance(v, int) and (isinstance(v, bool) or v < 1):
                raise ValueError(f"cpgraph.moe_experts: argument '{name}' must be a positive int, got {v!r}")
        if isinstance(i, int) and isinstance(block_n, int) and i % block_n:
            raise ValueError(
                f"cpgraph.moe_experts: FP8 experts need the intermediate size {i} to be a multiple of "
                f"block_n={block_n} (the stacked gate and up halves must not share a scale row)"
            )
        check_tensor(op, "gate_up_scale", gate_up_scale, dtype=torch.float32,
                     shape=(e, ceil_div(two_i, block_n), ceil_div(h, block_k)))
        check_tensor(op, "down_scale", down_scale, dtype=torch.float32,
                     shape=(e, ceil_div(h, block_n), ceil_div(i, block_k)))
    if num_valid is not None:
        check_tensor(op, "num_valid", num_valid, dtype=_INDEX, shape=(1,))
    check_same_device(op, x=x, topk_ids=topk_ids, topk_w=topk_w, gate_up=gate_up, down=down, num_valid=num_valid,
                      gate_up_scale=gate_up_scale, down_scale=down_scale)


def _routed_slots(topk_ids: Tensor, num_valid: Optional[Tensor], num_experts: int) -> Tensor:
    """``[M, k]`` bool: the slots that reach an expert (real row, id in range)."""
    m = topk_ids.shape[0]
    ok = (topk_ids >= 0) & (topk_ids < num_experts)
    if num_valid is not None:
        rows = torch.arange(m, device=topk_ids.device)
        ok = ok & (rows < num_valid.to(torch.int64).reshape(()))[:, None]
    return ok


# -------------------------------------------------------------- reference
def moe_experts_reference(x, topk_ids, topk_w, gate_up, down, num_valid=None, gate_up_scale=None, down_scale=None,
                          block_n=128, block_k=128, act_scale_pow2=False) -> Tensor:
    """Dense form: every expert on every row, combined with a ``[M, E]`` weight matrix zero off the routes.

    FP8 experts (scales given) take :func:`moe_experts_fp8_reference`.
    """
    if gate_up_scale is not None:
        return moe_experts_fp8_reference(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale,
                                         block_n, block_k, act_scale_pow2)
    e = gate_up.shape[0]
    routed = _routed_slots(topk_ids, num_valid, e)
    safe_ids = torch.where(routed, topk_ids, torch.zeros((), dtype=topk_ids.dtype, device=x.device)).long()
    w = torch.where(routed, topk_w, torch.zeros((), dtype=topk_w.dtype, device=x.device))
    combine = torch.zeros((x.shape[0], e), dtype=torch.float32, device=x.device).scatter_add(1, safe_ids, w)
    gate, up = torch.einsum("mh,eoh->emo", x, gate_up).chunk(2, dim=-1)
    y = torch.einsum("emi,ehi->emh", F.silu(gate) * up, down)  # [E, M, H]
    return torch.einsum("emh,me->mh", y, combine.to(y.dtype))


def _quantized(x: Tensor, block_k: int, pow2: bool) -> Tensor:
    """``x [R, K]`` quantised per row per ``block_k`` by the FP8 recipe and dequantised, in fp32."""
    q, scales = quantize_activations(x, block_k, pow2)
    return q.to(torch.float32) * scales.repeat_interleave(block_k, dim=1)[:, : x.shape[1]]


def moe_experts_fp8_reference(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale,
                              block_n, block_k, act_scale_pow2) -> Tensor:
    """Dense form of the FP8 experts: dequantised weights, quantised activations, fp32 products.

    Rounding points as the module docstring states (``gate`` / ``up`` and
    each expert's output in ``x``'s dtype, the combine in fp32), so the
    grouped GPU provider differs only in the order of fp32 sums.
    """
    e, two_i, h = gate_up.shape
    m = x.shape[0]
    routed = _routed_slots(topk_ids, num_valid, e)
    safe_ids = torch.where(routed, topk_ids, torch.zeros((), dtype=topk_ids.dtype, device=x.device)).long()
    w = torch.where(routed, topk_w, torch.zeros((), dtype=topk_w.dtype, device=x.device))
    combine = torch.zeros((m, e), dtype=torch.float32, device=x.device).scatter_add(1, safe_ids, w)
    hit = torch.zeros((m, e), dtype=torch.float32, device=x.device).scatter_add(1, safe_ids, routed.float()) > 0
    xq = _quantized(x, block_k, act_scale_pow2)  # [M, H]
    out = torch.zeros((m, h), dtype=torch.float32, device=x.device)
    for j in range(e):  # one expert at a time: the fp32 weights of all E experts need not coexist
        wg = dequantize_weight(gate_up[j], gate_up_scale[j], block_n, block_k)
        gate, up = (xq @ wg.t()).to(x.dtype).to(torch.float32).chunk(2, dim=-1)
        act = _quantized(F.silu(gate) * up, block_k, act_scale_pow2)
        wd = dequantize_weight(down[j], down_scale[j], block_n, block_k)
        y = (act @ wd.t()).to(x.dtype).to(torch.float32)
        # where, not a multiply: only the rows routed to expert j take its output (a non-finite row of
        # x gives NaN in every expert's output, and must reach only its own row).
        out += torch.where(hit[:, j : j + 1], y * combine[:, j : j + 1], torch.zeros((), device=x.device))
    return out.to(x.dtype)


# ------------------------------------------------------- grouped dispatch
class DispatchPlan(NamedTuple):
    """Where every ``(row, slot)`` pair goes, with static shapes (capacity ``C = M * k``).

    * ``order [C]`` int64: pair ids (``row * k + slot``) sorted by expert;
      pairs that route nowhere sort after every real one;
    * ``group_ends [E]`` int32: cumulative pair counts per expert (the
      ``offs`` of ``torch._grouped_mm``); ``group_ends[-1]`` = routed pairs,
      sorted positions past it are never computed nor read;
    * ``slot_pos [M, k]`` int64: the sorted position of each pair, ``-1``
      where the slot routes nowhere (the combine skips it).
    """

    order: Tensor
    group_ends: Tensor
    slot_pos: Tensor


def dispatch_plan(topk_ids: Tensor, num_valid: Optional[Tensor], num_experts: int) -> DispatchPlan:
    """Sort pairs by expert without host syncs: one stable sort, one ``searchsorted``."""
    m, k = topk_ids.shape
    routed = _routed_slots(topk_ids, num_valid, num_experts)
    nowhere = torch.full((), num_experts, dtype=torch.int32, device=topk_ids.device)
    keys = torch.where(routed, topk_ids.to(torch.int32), nowhere).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    experts = torch.arange(num_experts, dtype=torch.int32, device=keys.device)
    group_ends = torch.searchsorted(sorted_keys, experts, right=True).to(torch.int32)
    positions = torch.arange(m * k, dtype=torch.int64, device=keys.device)
    slot_pos = torch.empty_like(positions).scatter_(0, order, positions).view(m, k)
    slot_pos = torch.where(routed, slot_pos, torch.full((), -1, dtype=torch.int64, device=keys.device))
    return DispatchPlan(order, group_ends, slot_pos)


def combine_reference(y_sorted: Tensor, slot_pos: Tensor, topk_w: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out[m] = sum_j w[m, j] * y_sorted[slot_pos[m, j]]`` in fp32; ``-1`` slots add nothing."""
    m, k = slot_pos.shape
    used = slot_pos >= 0
    safe = torch.where(used, slot_pos, torch.zeros((), dtype=slot_pos.dtype, device=slot_pos.device))
    rows = y_sorted.index_select(0, safe.reshape(-1)).view(m, k, -1).float()
    # where, not a multiply: unread positions of y_sorted hold uninitialised memory (NaN possible).
    rows = torch.where(used[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return (rows * topk_w[..., None]).sum(1).to(out_dtype)


def moe_experts_grouped(
    x,
    topk_ids,
    topk_w,
    gate_up,
    down,
    num_valid=None,
    *,
    combine: Callable[[Tensor, Tensor, Tensor, torch.dtype], Tensor] = combine_reference,
    swiglu: Callable[[Tensor, Tensor], Tensor] | None = None,
    take_rows: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """Dispatch + grouped GEMMs; equals :func:`moe_experts_reference` within rounding.

    ``swiglu(h, group_ends)`` (a provider's fused kernel) replaces the eager
    ``silu(gate) * up``; it may leave rows past ``group_ends[-1]`` unwritten.
    ``take_rows(x, index)`` (a provider's row gather) replaces ``index_select``.

    ``torch._grouped_mm(A [C, K], B [E, K, N], offs)`` multiplies rows
    ``[offs[e-1], offs[e])`` of ``A`` by ``B[e]``; rows past ``offs[-1]`` are
    left unwritten, which is how rows ``>= num_valid`` cost nothing in the
    GEMMs.  The weights are passed as transposed views (no copy).
    """
    k = topk_ids.shape[1]
    plan = dispatch_plan(topk_ids, num_valid, gate_up.shape[0])
    src = plan.order // k
    xs = take_rows(x, src) if take_rows is not None else x.index_select(0, src)  # [C, H]
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=plan.group_ends)  # [C, 2I]
    if swiglu is not None:
        act = swiglu(h, plan.group_ends)
    else:
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=plan.group_ends)  # [C, H]
    return combine(y, plan.slot_pos, topk_w, x.dtype)


def grouped_mm_supported(x: Tensor, gate_up: Tensor) -> bool:
    """Whether :func:`moe_experts_grouped` runs for these operands (static facts only).

    ``torch._grouped_mm`` needs bf16 on CUDA (CPU also takes fp32) and
    16-byte aligned row strides of every operand (H, 2I and I).
    """
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    align = 16 // x.element_size()
    h, two_i = x.shape[1], gate_up.shape[1]
    return h % align == 0 and two_i % (2 * align) == 0


# --------------------------------------------------------------------- op
@torch.library.custom_op("cpgraph::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_w: Tensor,
    gate_up: Tensor,
    down: Tensor,
    num_valid: Optional[Tensor] = None,
    gate_up_scale: Optional[Tensor] = None,
    down_scale: Optional[Tensor] = None,
    block_n: int = 128,
    block_k: int = 128,
    act_scale_pow2: bool = False,
) -> Tensor:
    """Routed-expert output ``[M, H]`` (dtype of ``x``), see the module docstring.

    ``x [M, H]`` float; ``topk_ids [M, k]`` int32/int64 expert ids;
    ``topk_w [M, k]`` fp32 combine weights (already normalised and scaled);
    ``gate_up [E, 2I, H]`` (gate rows first, then up), ``down [E, H, I]``,
    both in ``x``'s dtype (transformers' stacked layout); ``num_valid``
    int64 ``[1]`` or ``None``: rows ``>= num_valid`` give exact zero rows.
    FP8 experts: ``gate_up`` / ``down`` in float8_e4m3fn with their block
    scales ``gate_up_scale`` / ``down_scale`` (blocks ``block_n x block_k``)
    and the activation recipe ``act_scale_pow2`` (module docstring).
    """
    _check_moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n, block_k)
    check_index_range("moe_experts", "topk_ids", topk_ids, 0, gate_up.shape[0])
    impl = select("moe_experts", x.device.type, moe_experts_reference)
    if gate_up_scale is None:
        return impl(x, topk_ids, topk_w, gate_up, down, num_valid)
    return impl(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n, block_k,
                act_scale_pow2)


@moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_w, gate_up, down, num_valid=None, gate_up_scale=None, down_scale=None,
                      block_n=128, block_k=128, act_scale_pow2=False):
    _check_moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n, block_k)
    return x.new_empty(x.shape)

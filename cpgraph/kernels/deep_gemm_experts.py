"""FP8 routed experts through DeepGEMM's m-grouped GEMM (SM90), where DeepGEMM is installed.

Why: cpgraph's Triton grouped FP8 GEMM (:mod:`.fp8_grouped`) runs at about
700 TFLOP/s at DeepSeek-V3.2's shapes, 1.06x the bf16 CUTLASS grouped GEMM
in the forward: each 128-wide K block's fp32 rescale waits on that block's
tensor-core dot, which Triton 3.6's ``tl.dot`` cannot overlap.  DeepGEMM's
SM90 kernel (``m_grouped_fp8_gemm_nt_contiguous``: TMA loads, producer and
consumer warpgroups, the rescale of one block overlapped with the next
block's wgmma) computes the same contract -- e4m3 operands, per-token x 128
activation scales, 128 x 128 weight-block scales, fp32 accumulation, bf16
out -- at DeepGEMM's rate.  Measured figures: docs/performance.md.

What cpgraph adds around it, all on the device with static shapes (no host
sync, CUDA-graph capturable):

* **layout.** DeepGEMM reads each expert's rows as one contiguous segment
  that starts on a 128-row boundary (its "psum" layout: ``psum[e]`` is the
  end row of expert ``e``, whose rows start at ``psum[e-1]`` rounded up to
  128).  :func:`padded_layout` maps the sorted rows of
  :func:`~cpgraph.ops.moe.dispatch_plan` to that layout: ``P = C + 128 E``
  rows cover every routing; gap rows are zero (gathered from index ``-1``),
  so the GEMMs compute zeros there and nothing reads them.
* **activations.** :func:`~.fp8_linear.quantize_activations` quantises the
  ``M`` tokens once; the row mover gathers their codes and scales into the
  padded layout (DeepGEMM's TMA loads need the rows in place, where the
  Triton GEMM gathers inside the kernel).
* **between the GEMMs**, :func:`~.fp8_grouped.swiglu_quantize` as in the
  Triton path, over rows ``< psum[-1]``; after them the Triton combine reads
  each slot's padded row.

A row's result depends only on that row's inputs (each output row is its
own A row against its expert's weights, K summed in a fixed order; no
split-K), so CP equals one device with this provider too.  Its bits differ
from the Triton grouped GEMM's (tile shapes, wgmma order): both are within
the op's FP8 tolerance of the reference.  Deterministic mode replaces
``cpgraph::moe_experts`` with ``cpgraph::invariant_moe_experts``, so this
provider never runs there.

Selection: ``CPGRAPH_FP8_EXPERTS=auto|deep_gemm|triton`` (default ``auto``:
DeepGEMM where it applies, else the Triton GEMM).  Each call is counted
under the GEMM that ran (:mod:`cpgraph.ops.ledger`).  Where the machine
rules DeepGEMM out (not installed, not SM90) that is a fallback, logged at
WARNING once; where the operands do (blocks other than 128 x 128, ``H`` or
``I`` not multiples of 128) it is the documented split, logged at INFO once.
Forcing ``deep_gemm`` where it does not apply raises.  Installing:
docs/ops/fp8_linear.md.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from cpgraph.ops import ledger
from cpgraph.ops.moe import dispatch_plan

from ._launch import interpreting
from .deep_gemm_lib import import_error, load, machine_reason
from .fp8_grouped import swiglu_quantize
from .fp8_linear import quantize_activations
from .moe_combine import combine
from .move import take_rows

BACKEND_ENV = "CPGRAPH_FP8_EXPERTS"
BACKENDS = ("auto", "deep_gemm", "triton")
BF16_ENV = "CPGRAPH_BF16_EXPERTS"
BF16_BACKENDS = ("auto", "deep_gemm", "grouped_mm")
# What ``auto`` takes for bf16 experts where it applies (docs/ops/fp8_linear.md#deepgemm-sm90 has the measurement:
# 1.05-1.06x ``torch._grouped_mm`` alone, routed experts 38.7 -> 34.9 ms in the two-layer V3.2 forward at 32K).
BF16_AUTO = "deep_gemm"
OP = "moe_experts"
NAME = "deep_gemm"
ALIGN = 128  # DeepGEMM's M alignment of an expert's segment on SM90 (its block M for grouped layouts)

def backend() -> str:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def _bf16_setting() -> str:
    """``CPGRAPH_BF16_EXPERTS`` as given (``auto`` unresolved): forcing and ``auto`` fail differently."""
    choice = os.environ.get(BF16_ENV, "auto").strip().lower() or "auto"
    if choice not in BF16_BACKENDS:
        raise ValueError(f"{BF16_ENV} must be one of {', '.join(BF16_BACKENDS)}, got {choice!r}")
    return choice


def bf16_backend() -> str:
    choice = _bf16_setting()
    return BF16_AUTO if choice == "auto" else choice


def operand_reason(x: Tensor, gate_up: Tensor, down: Tensor, block_n: int, block_k: int) -> str | None:
    """Why these operands do not fit DeepGEMM's grouped GEMM (``None`` if they do)."""
    if (block_n, block_k) != (128, 128):
        return f"weight blocks {block_n}x{block_k} (DeepGEMM takes 128x128)"
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} activations (DeepGEMM writes bf16)"
    h, two_i = x.shape[1], gate_up.shape[1]
    if h % 128 or two_i % 256:
        return f"H={h}, 2I={two_i} not multiples of 128 per operand"
    return None


def padded_layout(group_ends: Tensor, rows: int) -> tuple[Tensor, Tensor, int]:
    """``(pos [rows] int64, psum [E] int32, P)``: each sorted row's padded row, DeepGEMM's group ends, the size.

    Sorted rows past ``group_ends[-1]`` (routed nowhere) get ``-1``.  Expert
    ``e``'s rows start at ``a[e] = sum_{j<e} align(count_j)``: the end of
    ``e-1`` rounded up to ``ALIGN``, which is how DeepGEMM walks the layout.
    """
    ends = group_ends.to(torch.int64)
    starts = F.pad(ends[:-1], (1, 0))
    counts = ends - starts
    aligned = (counts + ALIGN - 1) // ALIGN * ALIGN
    astart = torch.cumsum(aligned, 0) - aligned
    psum = (astart + counts).to(torch.int32)
    r = torch.arange(rows, dtype=torch.int64, device=group_ends.device)
    e = torch.searchsorted(ends, r, right=True).clamp_(max=ends.numel() - 1)
    pos = torch.where(r < ends[-1], astart[e] + r - starts[e], torch.full_like(r, -1))
    return pos, psum, rows + ALIGN * ends.numel()


def _inverse(pos: Tensor, values: Tensor, size: int) -> Tensor:
    """``out [size]`` int64: ``out[pos[i]] = values[i]`` where ``pos[i] >= 0``, else ``-1`` (static shapes)."""
    out = torch.full((size + 1,), -1, dtype=torch.int64, device=pos.device)
    out.scatter_(0, torch.where(pos >= 0, pos, size), values)
    return out[:size]


class _Padded(NamedTuple):
    """One call's dispatch in DeepGEMM's layout: ``token [P]`` (-1 in the gaps), ``psum [E]``, slots -> padded rows."""

    token: Tensor
    psum: Tensor
    slot_rows: Tensor


def _padded_dispatch(topk_ids: Tensor, num_valid, experts: int) -> _Padded:
    m, k = topk_ids.shape
    plan = dispatch_plan(topk_ids, num_valid, experts)
    pos, psum, p = padded_layout(plan.group_ends, m * k)
    slot = plan.slot_pos
    return _Padded(_inverse(pos, plan.order // k, p), psum, torch.where(slot >= 0, pos[slot.clamp(min=0)], slot))


def moe_experts_fp8(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n: int,
                    block_k: int, act_scale_pow2: bool) -> Tensor:
    """FP8 routed experts: quantise, pad, DeepGEMM gate/up, SwiGLU + quant, DeepGEMM down, combine."""
    dg = load()
    d = _padded_dispatch(topk_ids, num_valid, gate_up.shape[0])
    xq, xs = quantize_activations(x, block_k, act_scale_pow2)
    a, a_s = take_rows(xq, d.token), take_rows(xs, d.token)
    h = torch.empty((d.token.shape[0], gate_up.shape[1]), dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((a, a_s), (gate_up, gate_up_scale), h, d.psum, use_psum_layout=True)
    aq, aq_s = swiglu_quantize(h, d.psum, block_k, act_scale_pow2)
    y = torch.empty((d.token.shape[0], down.shape[1]), dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((aq, aq_s), (down, down_scale), y, d.psum, use_psum_layout=True)
    return combine(y, d.slot_rows, topk_w, x.dtype)


def moe_experts_bf16(x, topk_ids, topk_w, gate_up, down, num_valid) -> Tensor:
    """bf16 routed experts: gather into the padded layout, DeepGEMM gate/up, Triton SwiGLU, DeepGEMM down, combine.

    The gather replaces the grouped_mm path's gather of the same rows (same bytes, other places).
    """
    from .swiglu import swiglu

    dg = load()
    d = _padded_dispatch(topk_ids, num_valid, gate_up.shape[0])
    xs = take_rows(x, d.token)
    h = torch.empty((d.token.shape[0], gate_up.shape[1]), dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(xs, gate_up, h, d.psum, use_psum_layout=True)
    act = swiglu(h, d.psum)
    y = torch.empty((d.token.shape[0], down.shape[1]), dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(act, down, y, d.psum, use_psum_layout=True)
    return combine(y, d.slot_rows, topk_w, x.dtype)


def choose_bf16(x, gate_up) -> bool:
    """Whether bf16 experts run DeepGEMM (``CPGRAPH_BF16_EXPERTS``); counts the call when they do.

    As the FP8 experts choose: at ``auto`` a machine that rules DeepGEMM out
    (not installed, not SM90) is a fallback to ``torch._grouped_mm``, WARNING
    once; operands it does not take (H or 2I not multiples of 128 / 256) are
    the documented split, INFO once; ``deep_gemm`` forced where it does not
    apply raises.
    """
    if x.device.type != "cuda" or interpreting():
        return False
    setting = _bf16_setting()
    if (BF16_AUTO if setting == "auto" else setting) == "grouped_mm":
        return False
    machine = machine_reason(x)
    why_not = machine
    if why_not is None and (x.dtype != torch.bfloat16 or x.shape[1] % 128 or gate_up.shape[1] % 256):
        why_not = f"{x.dtype} H={x.shape[1]}, 2I={gate_up.shape[1]} (DeepGEMM takes bf16, multiples of 128)"
    if why_not is None:
        ledger.ran_as(OP, x.device.type, NAME)
        return True
    if setting == "deep_gemm":
        raise ValueError(f"cpgraph.moe_experts: {BF16_ENV}=deep_gemm but {why_not}")
    if machine is not None:
        ledger.fell_back(OP, x.device.type, "triton", why_not, instead_of=NAME)
    else:
        ledger.ran_as(OP, x.device.type, "triton", why_not)
    return False


def choose(x, gate_up, down, block_n: int, block_k: int) -> bool:
    """Whether this call runs DeepGEMM; counts the call and logs a fallback or split once per reason."""
    if x.device.type != "cuda" or interpreting():
        return False  # the interpreter and CPU tensors: Triton is the only candidate, nothing to report
    choice = backend()
    device = x.device.type
    if choice == "triton":
        ledger.ran_as(OP, device, "triton", f"{BACKEND_ENV}=triton")
        return False
    machine = machine_reason(x)
    why_not = machine or operand_reason(x, gate_up, down, block_n, block_k)
    if choice == "deep_gemm" and why_not is not None:
        raise ValueError(f"cpgraph.moe_experts: {BACKEND_ENV}=deep_gemm but {why_not}")
    if why_not is None:
        ledger.ran_as(OP, device, NAME)
        return True
    if machine is not None:
        ledger.fell_back(OP, device, "triton", why_not, instead_of=NAME)
    else:
        ledger.ran_as(OP, device, "triton", why_not)
    return False


__all__ = ["BACKEND_ENV", "BF16_ENV", "choose", "choose_bf16", "import_error", "load", "moe_experts_bf16",
           "moe_experts_fp8", "padded_layout"]

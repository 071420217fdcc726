"""Row-invariant ops: ``cpgraph::invariant_mm``, ``invariant_fp8_linear``, ``invariant_moe_experts``, ``invariant_mla_query``.

Why: in deterministic mode (``CPConfig(deterministic=True)``,
docs/deterministic.md) a row's result must depend only on that row's inputs
and the model -- never on how many rows the product had, which requests
share the batch, how much of the prompt was cached, how it was chunked, or
the CP size.  Every other op of the forward already is row-local with
shapes that do not depend on the row count (elementwise ops, reductions
along one row, the indexer and sparse-MLA kernels, data movement); the
products are not: cuBLAS and MKL pick kernels and split work by ``M``, the
grouped expert GEMM's tiles follow the routing.  These four ops are the
products of the forward, each with the contract of the op it replaces and
one extra promise:

    out[.., i, :] depends only on row i of the row operand (and the weights),
    computed in one fixed order whatever the row count.

* ``invariant_mm(a, b, bias, beta, alpha)``: ``alpha * a @ b + beta * bias``
  for ``a [M, K]`` / ``[B, M, K]``, ``b [K, N]`` / ``[B, K, N]``, ``bias``
  broadcastable to the output; fp32 accumulation (fp64 for fp64), one
  rounding to ``a``'s dtype.  Replaces ``aten.mm`` / ``addmm`` / ``bmm`` /
  ``baddbmm`` (the dense linears, the router, the absorbed ``W_UV``
  product, the LM head);
* ``invariant_fp8_linear``: ``cpgraph::fp8_block_linear``'s contract;
* ``invariant_moe_experts``: ``cpgraph::moe_experts``' contract, with the
  combine of each row summed over its top-k slots ``j = 0, 1, ..`` in order
  (fp32), so a row's output does not depend on which other rows chose which
  experts;
* ``invariant_mla_query``: ``cpgraph::mla_query``'s contract (RoPE in fp32,
  one rounding).

References (CPU): :mod:`.invariant_core`'s fixed-order products, bitwise
row-invariant on any machine and thread count.  CUDA providers
(:mod:`cpgraph.kernels.invariant_gemm`): Triton GEMMs whose tile
configuration is a function of the weight shape and dtype only, with no
split-K and a K loop in order, so every row of every tile runs the same
instructions in the same order.  CPU and CUDA results are not bitwise equal
to each other (tensor-core dot products sum in hardware order); each is
invariant on its own.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor
from .fp8_linear import check_fp8_block_linear, dequantize_weight, quantize_activations
from .invariant_core import fixed_order_matmul, scaled_sum, silu, silu_f32
from .mla_output import check_mla_output
from .mla_query import _check_mla_query, rope_interleaved
from .moe import _check_moe_experts, _routed_slots
from .providers import select

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ------------------------------------------------------------------ checks
def check_invariant_mm(a, b, bias=None) -> None:
    """Metadata checks of ``invariant_mm`` (shared by the op, its fake rule and the providers)."""
    op = "invariant_mm"
    check_tensor(op, "a", a, dtype=FLOATS)
    if a.dim() not in (2, 3):
        raise ValueError(f"cpgraph.{op}: argument 'a' must be 2-D [M, K] or 3-D [B, M, K], got {tuple(a.shape)}")
    batch = (a.shape[0],) if a.dim() == 3 else ()
    check_tensor(op, "b", b, dtype=a.dtype, shape=batch + (a.shape[-1], None))
    if bias is not None:
        check_tensor(op, "bias", bias, dtype=a.dtype)
        out = tuple(a.shape[:-1]) + (b.shape[-1],)
        if bias.dim() > len(out) or any(
            isinstance(s, int) and isinstance(o, int) and s not in (1, o)
            for s, o in zip(reversed(tuple(bias.shape)), reversed(out))
        ):
            raise ValueError(f"cpgraph.{op}: argument 'bias' of shape {tuple(bias.shape)} does not broadcast to "
                             f"the output {out}")
    check_same_device(op, a=a, b=b, bias=bias)


def out_shape(a: Tensor, b: Tensor) -> tuple:
    return tuple(a.shape[:-1]) + (b.shape[-1],)


# -------------------------------------------------------------- references
def invariant_mm_reference(a, b, bias=None, beta=1.0, alpha=1.0) -> Tensor:
    """Fixed-order product, ``alpha`` / ``beta * bias`` added in fp32, one rounding (addmm's epilogue)."""
    return scaled_sum(fixed_order_matmul(a, b), bias, beta, alpha).to(a.dtype)


def invariant_fp8_linear_reference(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2) -> Tensor:
    """``fp8_block_linear``'s definition with the fp32 product summed in the fixed order."""
    q, scales = quantize_activations(x, block_k, act_scale_pow2)
    k = x.shape[1]
    x_deq = q.to(torch.float32) * scales.repeat_interleave(block_k, dim=1)[:, :k]
    w_deq = dequantize_weight(weight, weight_scale_inv, block_n, block_k)
    return fixed_order_matmul(x_deq, w_deq.t()).to(x.dtype)


def _dequantized_rows(x: Tensor, block_k: int, pow2: bool) -> Tensor:
    """``x [R, K]`` quantised per row per ``block_k`` by the FP8 recipe and dequantised, fp32 (row-local)."""
    q, scales = quantize_activations(x, block_k, pow2)
    return q.to(torch.float32) * scales.repeat_interleave(block_k, dim=1)[:, : x.shape[1]]


def _expert_outputs(x, gate_up, down, gate_up_scale, down_scale, block_n, block_k, pow2) -> Tensor:
    """``[E, M, H]`` in ``x``'s dtype: every expert on every row (dense; each row by the fixed-order products).

    Rounding points as ``moe_experts`` states: ``gate`` / ``up`` and each
    expert's output in ``x``'s dtype; bf16 experts take ``silu(gate) * up``
    in ``x``'s dtype (two roundings, as the grouped provider's torch ops),
    FP8 experts in fp32 from the rounded ``gate`` / ``up`` before the
    activation quantisation.
    """
    fp8 = gate_up_scale is not None
    xin = _dequantized_rows(x, block_k, pow2) if fp8 else x
    outs = []
    for e in range(gate_up.shape[0]):
        wg = dequantize_weight(gate_up[e], gate_up_scale[e], block_n, block_k) if fp8 else gate_up[e]
        gate, up = fixed_order_matmul(xin, wg.t()).to(x.dtype).chunk(2, dim=-1)
        if fp8:
            act = _dequantized_rows(silu_f32(gate) * up.float(), block_k, pow2)
            wd = dequantize_weight(down[e], down_scale[e], block_n, block_k)
        else:
            act, wd = silu(gate) * up, down[e]
        outs.append(fixed_order_matmul(act, wd.t()).to(x.dtype))
    return torch.stack(outs) if outs else x.new_zeros((0,) + tuple(x.shape))


def combine_in_slot_order(expert_rows: Tensor, topk_ids: Tensor, topk_w: Tensor, routed: Tensor,
                          out_dtype: torch.dtype) -> Tensor:
    """``out[m] = sum_j w[m, j] * expert_rows[ids[m, j], m]``, ``j = 0, 1, ..`` in order, fp32, unrouted slots skipped.

    ``torch.where`` (not a multiply by 0) skips a slot, so a non-finite
    expert row of another route never reaches this row.
    """
    m, k = topk_ids.shape
    rows = torch.arange(m, device=topk_ids.device)
    acc = torch.zeros((m, expert_rows.shape[-1]), dtype=torch.float32, device=expert_rows.device)
    zero = torch.zeros((), dtype=torch.float32, device=expert_rows.device)
    for j in range(k):
        ids = torch.where(routed[:, j], topk_ids[:, j], torch.zeros((), dtype=topk_ids.dtype,
                                                                     device=topk_ids.device)).long()
        y = expert_rows[ids, rows].float()
        acc = acc + torch.where(routed[:, j : j + 1], topk_w[:, j : j + 1] * y, zero)
    return acc.to(out_dtype)


def invariant_moe_experts_reference(x, topk_ids, topk_w, gate_up, down, num_valid=None, gate_up_scale=None,
                                    down_scale=None, block_n=128, block_k=128, act_scale_pow2=False) -> Tensor:
    """Every expert on every row (fixed-order products), then the combine in top-k slot order."""
    routed = _routed_slots(topk_ids, num_valid, gate_up.shape[0])
    y = _expert_outputs(x, gate_up, down, gate_up_scale, down_scale, block_n, block_k, act_scale_pow2)
    if y.shape[0] == 0:
        return torch.zeros_like(x)
    return combine_in_slot_order(y, topk_ids, topk_w, routed, x.dtype)


def invariant_mla_query_reference(q: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``[q_nope @ W_UK | rope(q_pe)]``: per-head fixed-order product, RoPE in fp32 rounded once."""
    nope = w_uk.shape[1]
    q_nope, q_pe = q.split([nope, q.shape[2] - nope], dim=-1)
    q_abs = fixed_order_matmul(q_nope.transpose(0, 1), w_uk).to(q.dtype).transpose(0, 1)  # [M, H, L]
    rope = rope_interleaved(q_pe.float(), cos.float(), sin.float()).to(q.dtype)
    return torch.cat((q_abs, rope), dim=-1)


def invariant_mla_output_reference(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``out_lat @ W_UV^T`` per head in one fixed order, as ``[M, H * v]`` rows."""
    m, h, _ = out_lat.shape
    out = fixed_order_matmul(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).to(out_lat.dtype)  # [H, M, v]
    return out.transpose(0, 1).reshape(m, h * w_uv.shape[1])


# ---------------------------------------------------------------------- ops
@torch.library.custom_op("cpgraph::invariant_mm", mutates_args=())
def invariant_mm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, beta: float = 1.0,
                 alpha: float = 1.0) -> Tensor:
    """``alpha * a @ b + beta * bias`` (``[.., M, N]``, ``a``'s dtype), each row in one fixed order (module docstring)."""
    check_invariant_mm(a, b, bias)
    return select("invariant_mm", a.device.type, invariant_mm_reference)(a, b, bias, beta, alpha)


@invariant_mm.register_fake
def _invariant_mm_fake(a, b, bias=None, beta=1.0, alpha=1.0):
    check_invariant_mm(a, b, bias)
    return a.new_empty(out_shape(a, b))


@torch.library.custom_op("cpgraph::invariant_fp8_linear", mutates_args=())
def invariant_fp8_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, block_n: int, block_k: int,
                         act_scale_pow2: bool) -> Tensor:
    """``cpgraph::fp8_block_linear`` whose rows do not depend on the row count (module docstring)."""
    check_fp8_block_linear(x, weight, weight_scale_inv, block_n, block_k)
    impl = select("invariant_fp8_linear", x.device.type, invariant_fp8_linear_reference)
    return impl(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2)


@invariant_fp8_linear.register_fake
def _invariant_fp8_linear_fake(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2):
    check_fp8_block_linear(x, weight, weight_scale_inv, block_n, block_k)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("cpgraph::invariant_moe_experts", mutates_args=())
def invariant_moe_experts(
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
    """``cpgraph::moe_experts`` with a row-invariant expert product and the combine in top-k slot order."""
    _check_moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n, block_k)
    check_index_range("invariant_moe_experts", "topk_ids", topk_ids, 0, gate_up.shape[0])
    impl = select("invariant_moe_experts", x.device.type, invariant_moe_experts_reference)
    return impl(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n, block_k,
                act_scale_pow2)


@invariant_moe_experts.register_fake
def _invariant_moe_experts_fake(x, topk_ids, topk_w, gate_up, down, num_valid=None, gate_up_scale=None,
                                down_scale=None, block_n=128, block_k=128, act_scale_pow2=False):
    _check_moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n, block_k)
    return x.new_empty(x.shape)


@torch.library.custom_op("cpgraph::invariant_mla_query", mutates_args=())
def invariant_mla_query(q: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``cpgraph::mla_query`` whose rows do not depend on the row count (module docstring)."""
    _check_mla_query(q, w_uk, cos, sin)
    return select("invariant_mla_query", q.device.type, invariant_mla_query_reference)(q, w_uk, cos, sin)


@invariant_mla_query.register_fake
def _invariant_mla_query_fake(q, w_uk, cos, sin):
    _check_mla_query(q, w_uk, cos, sin)
    return q.new_empty((q.shape[0], q.shape[1], w_uk.shape[2] + q.shape[2] - w_uk.shape[1]))


@torch.library.custom_op("cpgraph::invariant_mla_output", mutates_args=())
def invariant_mla_output(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``cpgraph::mla_output`` whose rows do not depend on the row count (module docstring)."""
    check_mla_output(out_lat, w_uv, "invariant_mla_output")
    return select("invariant_mla_output", out_lat.device.type, invariant_mla_output_reference)(out_lat, w_uv)


@invariant_mla_output.register_fake
def _invariant_mla_output_fake(out_lat, w_uv):
    check_mla_output(out_lat, w_uv, "invariant_mla_output")
    return out_lat.new_empty((out_lat.shape[0], out_lat.shape[1] * w_uv.shape[1]))


# The op each invariant op stands in for (the rewrite pass and the deterministic mode use this one table).
REPLACES = {
    "moe_experts": "invariant_moe_experts",
    "fp8_block_linear": "invariant_fp8_linear",
    "mla_query": "invariant_mla_query",
    "mla_output": "invariant_mla_output",
}

__all__ = [
    "REPLACES",
    "check_invariant_mm",
    "combine_in_slot_order",
    "invariant_fp8_linear",
    "invariant_fp8_linear_reference",
    "invariant_mla_query",
    "invariant_mla_query_reference",
    "invariant_mm",
    "invariant_mm_reference",
    "invariant_moe_experts",
    "invariant_moe_experts_reference",
]

"""RMSNorm with the FP8 activation quantisation of its output: ``cpgraph::fp8_rms_norm_quantize``.

Why an op: in the DSA family every FP8 projection group reads a normed
activation.  ``q_a``, ``kv_a`` and the indexer's ``wk`` read
``input_layernorm(x + mlp)``; ``q_b`` and the indexer's ``wq_b`` read
``q_a_layernorm(q_a(x))``; a dense MLP's ``gate`` and ``up`` read
``post_attention_layernorm(x + attn)``.  Unfused, Inductor's residual-add +
norm kernel writes the bf16 normed rows and ``fp8_quantize_activations``
reads them back (one full pass over ``[M, hidden]``, 26 us at 4096 x 7168
on an H200: as long as ``kv_a``'s whole FP8 GEMM).  Here one row-local
kernel adds, normalises and quantises: the codes and scales come out of the
pass that computes the norm (docs/ops/fp8_linear.md, "Quantisation fused
into the norm").  The pass ``fuse_norm_into_quantization`` puts it in.

Contract, per row (``x [..., K]``: ``M`` rows, the product of the leading dims; ``weight [K]``)::

    s      = x + residual, rounded to x.dtype         (x itself without a residual)
    h      = ((float(s) * rsqrt(mean(float(s)^2) + eps)) * float(weight)), rounded to x.dtype
    q, sc  = fp8_quantize_activations(h, group, pow2)  (the same recipe, on the rounded h)

Returns ``(summed, normed, q, scales)``:

* ``summed`` (``s``, ``x``'s shape) when ``residual`` is given, else ``[0, K]``;
* ``normed`` (``h``, ``x``'s shape) when ``emit_normed``, else ``[0, K]`` (the
  bf16 rows are not written when only FP8 projections read them);
* ``q`` ``[M, K]`` e4m3 and ``scales`` ``[M, ceil(K / group)]`` fp32,
  column-major (strides ``(1, M)``), what ``fp8_linear_quantized`` takes.

``x`` keeps its leading dims so that a graph rewrite needs no reshape with
symbolic sizes around the op (the norm's input is ``[batch, seq, K]``).

This is the arithmetic of ``F.rms_norm(s, (K,), weight.to(s.dtype), eps)``
as torch decomposes it (statistics in fp32, one rounding after the weight).
Providers differ only in the order in which a row's squares are summed,
so ``h`` may differ from the unfused norm's in the last bit of a value;
the codes are always those of the ``h`` returned (by construction: one
quantisation of one rounded ``h``).  Every output row depends on that row's
inputs only.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .fp8_linear import FLOATS, FP8, ceil_div, quantize_activations_reference
from .providers import select

OP = "fp8_rms_norm_quantize"


def check_rms_norm_quantize(x, residual, weight, eps, group) -> None:
    """Metadata checks shared by the op, its fake rule and the providers (no data read)."""
    if isinstance(group, bool) or not isinstance(group, (int, torch.SymInt)) or (isinstance(group, int) and group < 1):
        raise ValueError(f"cpgraph.{OP}: argument 'group' must be a positive int, got {group!r}")
    if not isinstance(eps, float) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"cpgraph.{OP}: argument 'eps' must be a finite float >= 0, got {eps!r}")
    check_tensor(OP, "x", x, dtype=FLOATS)
    if x.dim() < 2:
        raise ValueError(f"cpgraph.{OP}: argument 'x' must be [..., K] with rows, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    if isinstance(k, int) and k == 0:
        raise ValueError(f"cpgraph.{OP}: argument 'x' must have at least one column, got shape {tuple(x.shape)}")
    if residual is not None:
        check_tensor(OP, "residual", residual, dtype=(x.dtype,), shape=tuple(x.shape))
    check_tensor(OP, "weight", weight, dtype=FLOATS, shape=(k,))
    check_same_device(OP, x=x, residual=residual, weight=weight)


def rows_of(x):
    """``M``: the product of ``x``'s leading dims (ints or SymInts)."""
    return functools.reduce(operator.mul, x.shape[:-1], 1)


def rms_norm_quantize_reference(x, residual, weight, eps, group, pow2, emit_normed):
    """The contract in torch ops (the oracle; CPU's provider)."""
    s = x + residual if residual is not None else x
    sf = s.to(torch.float32)
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    h = (sf * rstd * weight.to(torch.float32)).to(x.dtype)
    q, scales = quantize_activations_reference(h.reshape(-1, x.shape[-1]), group, pow2)
    empty = x.new_empty((0, x.shape[-1]))
    return (s if residual is not None else empty), (h if emit_normed else empty.clone()), q, scales


@torch.library.custom_op("cpgraph::fp8_rms_norm_quantize", mutates_args=())
def fp8_rms_norm_quantize(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, group: int, pow2: bool, emit_normed: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x + residual, rms_norm(...) * weight, e4m3 codes, column-major scales)`` of each row (module docstring).

    ``summed`` is ``[0, K]`` without ``residual``, ``normed`` ``[0, K]`` unless ``emit_normed``.
    """
    check_rms_norm_quantize(x, residual, weight, eps, group)
    impl = select(OP, x.device.type, rms_norm_quantize_reference)
    return impl(x, residual, weight, eps, group, pow2, emit_normed)


@fp8_rms_norm_quantize.register_fake
def _fp8_rms_norm_quantize_fake(x, residual, weight, eps, group, pow2, emit_normed):
    check_rms_norm_quantize(x, residual, weight, eps, group)
    m, k = rows_of(x), x.shape[-1]
    summed = x.new_empty(x.shape if residual is not None else (0, k))
    normed = x.new_empty(x.shape if emit_normed else (0, k))
    return summed, normed, x.new_empty((m, k), dtype=FP8), x.new_empty((ceil_div(k, group), m), dtype=torch.float32).t()


__all__ = ["fp8_rms_norm_quantize", "rms_norm_quantize_reference", "check_rms_norm_quantize", "rows_of"]

"""Row-invariant torch arithmetic: products summed in one fixed order, sigmoid / SiLU from ``exp``.

Why: the bits of a BLAS product row depend on how many rows the product had
(MKL picks kernels and splits work by shape and thread count), and the CPU
kernels of ``sigmoid`` / ``silu`` round the vector body and the scalar tail
of a tensor differently, so an element's bits depend on where it sits.  A CP
rank computes fewer rows than one device, a cache hit only the extend rows,
a chunk only its chunk: none of those runs can then promise the
single-device bits.  The functions here compute each output element from its
own inputs by one fixed sequence of IEEE operations, so a row gets the same
bits in a tensor of any row count, at any thread count, on any machine
(docs/bitwise.md, docs/deterministic.md).

* :func:`fixed_order_matmul`: ``a [.., M, K] @ b [.., K, N]`` as
  ``sum_k a[.., :, k] * b[.., k, :]`` for ``k = 0, 1, ..`` in order, one
  multiply and one add per step on whole tensors (elementwise ops: one
  correctly rounded operation per element), in fp32 (fp64 stays fp64;
  integers are exact in any order).  ``2K`` tensor ops per product: slow,
  meant for the CPU references at test and debugging sizes;
* :func:`sigmoid` / :func:`silu`: ``1 / (1 + exp(-x))`` and
  ``x / (1 + exp(-x))`` from ``exp``, whose CPU kernel runs one vector
  routine for every lane, partial vectors included.

``tests/row_invariant.py`` (the suite's ``bitexact`` marker) and the
deterministic mode (:mod:`cpgraph.ops.invariant_mode`) install these as the
CPU kernels of ``aten.mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` / ``sigmoid``
/ ``silu``; the ``cpgraph::invariant_*`` ops use them as their references.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CALLS = {"n": 0}  # products computed here (tests check that a forward really ran through them)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for float inputs below fp64 (what a GEMM accumulates in), fp64 for fp64, integers as they are."""
    if not dtype.is_floating_point:
        return dtype  # integer products are exact in any order
    return torch.float64 if dtype == torch.float64 else torch.float32


def fixed_order_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a [.., M, K] @ b [.., K, N]`` summed over ``k = 0, 1, ..`` in order, in the accumulation dtype.

    Leading dims broadcast like ``torch.matmul``'s.  The result is not
    rounded to the inputs' dtype: callers add a bias or scale first and round
    once, as a GEMM epilogue does.
    """
    _CALLS["n"] += 1
    acc = accumulation_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    k_len = a.shape[-1]
    if k_len == 0:
        shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        return a.new_zeros(shape)
    out = a[..., :, 0:1] * b[..., 0:1, :]
    for k in range(1, k_len):
        out = out + a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return out


def scaled_sum(prod: Tensor, bias: Tensor | None, beta=1, alpha=1) -> Tensor:
    """``alpha * prod + beta * bias`` in ``prod``'s dtype (``addmm``'s epilogue; ``beta = 0`` ignores ``bias``)."""
    if alpha != 1:
        prod = prod * alpha
    if bias is not None and beta != 0:
        prod = prod + (bias.to(prod.dtype) if beta == 1 else bias.to(prod.dtype) * beta)
    return prod


def products_computed() -> int:
    """How many products :func:`fixed_order_matmul` has computed in this process so far."""
    return _CALLS["n"]


def sigmoid_f32(x: Tensor) -> Tensor:
    """``1 / (1 + exp(-x))`` in the accumulation dtype (not rounded back)."""
    xf = x.to(accumulation_dtype(x.dtype))
    return 1.0 / (1.0 + torch.exp(-xf))


def silu_f32(x: Tensor) -> Tensor:
    """``x / (1 + exp(-x))`` in the accumulation dtype (not rounded back)."""
    xf = x.to(accumulation_dtype(x.dtype))
    return xf / (1.0 + torch.exp(-xf))


def sigmoid(x: Tensor) -> Tensor:
    """Position-invariant ``torch.sigmoid``: computed in fp32, rounded once to ``x``'s dtype."""
    return sigmoid_f32(x).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """Position-invariant ``F.silu``: computed in fp32, rounded once to ``x``'s dtype.

    On CUDA the elementwise kernels apply one formula to every element, so
    ``F.silu`` itself is position-invariant there and is used (one kernel
    instead of four).
    """
    if x.device.type == "cuda":
        return torch.nn.functional.silu(x)
    return silu_f32(x).to(x.dtype)


__all__ = [
    "accumulation_dtype",
    "fixed_order_matmul",
    "products_computed",
    "scaled_sum",
    "sigmoid",
    "sigmoid_f32",
    "silu",
    "silu_f32",
]

"""Matrix products whose every output element has one fixed summation order: the bit-exact tests' GEMMs.

Why: the bit-exact tests compare two runs that compute the same token rows
inside matrix products of different row counts M (a CP rank's rows against
the whole batch on one device; a cache hit's extend rows against a cold
run of the whole prompt).  A BLAS GEMM's bits for one row depend on M and
on the thread count (MKL picks kernels and splits the work by shape), so
such a comparison would hold on one machine and fail on another.  Inside
:func:`row_invariant_matmul` the CPU kernels of ``aten.mm``, ``addmm``,
``bmm`` and ``baddbmm`` (what ``nn.Linear``, ``matmul`` and ``einsum``
lower to) compute ``out[.., i, j] = a[.., i, 0] * b[.., 0, j] + a[.., i, 1] *
b[.., 1, j] + ...`` left to right, one IEEE multiply and one add per step on
whole tensors: each element's bits depend only on its own row of ``a``, its
column of ``b`` and ``K`` -- not on M, N, the batch size, the thread count
or memory alignment.  Every other op of the forward is already row-local
(elementwise, or a reduction along one row of fixed length), so two runs
that give a row the same inputs give it the same bits.  docs/bitwise.md.

The products accumulate in fp32 (fp64 stays fp64) and round to the input
dtype once, like a GEMM; they are slow (``2K`` tensor ops per product), which
is fine at the tests' tiny shapes.  Only the process that enters the context
is affected (a spawned rank enters it in its own job).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

_CALLS = {"n": 0}  # products computed here (a test checks the context really ran its GEMMs)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        return dtype  # integer products are exact in any order
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fixed_order_bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a [.., M, K] @ b [.., K, N]`` summed over ``k = 0, 1, ..`` in order, in the accumulation dtype."""
    _CALLS["n"] += 1
    acc = _acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    K = a.shape[-1]
    if K == 0:
        return a.new_zeros(*a.shape[:-1], b.shape[-1])
    out = a[..., :, 0:1] * b[..., 0:1, :]
    for k in range(1, K):
        out = out + a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return out


def _scaled(prod: Tensor, bias: Tensor | None, beta, alpha) -> Tensor:
    if alpha != 1:
        prod = prod * alpha
    if bias is not None and beta != 0:
        prod = prod + (bias.to(prod.dtype) if beta == 1 else bias.to(prod.dtype) * beta)
    return prod


def _mm(a, b):
    return _fixed_order_bmm(a, b).to(a.dtype)


def _mm_out(a, b, *, out):
    return out.copy_(_fixed_order_bmm(a, b))


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled(_fixed_order_bmm(a, b), bias, beta, alpha).to(a.dtype)


def _addmm_out(bias, a, b, *, beta=1, alpha=1, out):
    return out.copy_(_scaled(_fixed_order_bmm(a, b), bias, beta, alpha))


def _addmm_(bias, a, b, *, beta=1, alpha=1):
    return bias.copy_(_scaled(_fixed_order_bmm(a, b), bias, beta, alpha))


# Elementwise ops whose CPU kernel computes the body of a tensor with vector code and the last few
# elements (and each thread's last few) with a scalar formula that rounds differently: an element's
# bits then depend on where it sits in the tensor, i.e. on the row count.  Recomputed here from ops
# that apply one formula to every element (``exp``: one vector routine for all lanes, partial
# vectors included; ``+`` and ``/``: one IEEE operation).
def _sigmoid_f32(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x.to(_acc_dtype(x.dtype))))


def _silu_f32(x: Tensor) -> Tensor:
    xf = x.to(_acc_dtype(x.dtype))
    return xf / (1.0 + torch.exp(-xf))


def _unary(formula):
    def functional(x):
        return formula(x).to(x.dtype)

    def out_variant(x, *, out):
        return out.copy_(formula(x))

    def in_place(x):
        return x.copy_(formula(x))

    return functional, out_variant, in_place


_KERNELS = {
    "mm": _mm,
    "mm.out": _mm_out,
    "addmm": _addmm,
    "addmm.out": _addmm_out,
    "addmm_": _addmm_,
    "bmm": _mm,
    "bmm.out": _mm_out,
    "baddbmm": _addmm,
    "baddbmm.out": _addmm_out,
    "baddbmm_": _addmm_,
}
for _name, _formula in (("sigmoid", _sigmoid_f32), ("silu", _silu_f32)):
    _KERNELS[_name], _KERNELS[_name + ".out"], _KERNELS[_name + "_"] = _unary(_formula)


@contextlib.contextmanager
def row_invariant_matmul(expect_products: bool = True) -> Iterator[None]:
    """Within the block, CPU matrix products of this process use the fixed summation order above.

    ``expect_products``: fail if the block computed no product here (a forward that bypassed the
    replaced kernels would otherwise make a bit-exact comparison pass or fail by luck again).
    """
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    before = _CALLS["n"]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for name, fn in _KERNELS.items():
                lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()
    if expect_products and _CALLS["n"] == before:
        raise AssertionError("no matrix product ran inside row_invariant_matmul(): nothing was made row-invariant")


def products_computed() -> int:
    """How many matrix products :func:`row_invariant_matmul` has computed in this process so far."""
    return _CALLS["n"]

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

The kernels are the CPU half of cpgraph's deterministic mode
(:func:`cpgraph.ops.invariant_mode.fixed_order_cpu_kernels`, arithmetic in
:mod:`cpgraph.ops.invariant_core`): the suite's ``bitexact`` tests run in
that mode's CPU kernels.  The products accumulate in fp32 (fp64 stays fp64)
and round to the input dtype once, like a GEMM; they are slow (``2K`` tensor
ops per product), which is fine at the tests' tiny shapes.  Only the process
that enters the context is affected (a spawned rank enters it in its own job).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from cpgraph.ops.invariant_core import products_computed
from cpgraph.ops.invariant_mode import fixed_order_cpu_kernels


@contextlib.contextmanager
def row_invariant_matmul(expect_products: bool = True) -> Iterator[None]:
    """Within the block, CPU matrix products of this process use the fixed summation order above.

    ``expect_products``: fail if the block computed no product here (a forward that bypassed the
    replaced kernels would otherwise make a bit-exact comparison pass or fail by luck again).
    """
    with fixed_order_cpu_kernels(expect_products=expect_products):
        yield


__all__ = ["products_computed", "row_invariant_matmul"]

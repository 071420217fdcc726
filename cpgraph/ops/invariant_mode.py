"""The deterministic mode at run time: which kernels this process computes with while it is on.

Why a run-time mode next to the compiler pass (``passes/invariant_kernels.py``):
the pass rewrites the products a compiled graph holds, but it cannot see
inside ops -- the CPU references of the indexer, sparse MLA or the Hadamard
rotation multiply matrices with ``torch.matmul`` -- and an eager forward has
no graph at all.  Inside :func:`deterministic` (process-wide, re-entrant;
``cpgraph.compile`` enters it around every call of a forward compiled with
``CPConfig(deterministic=True)``):

* the CPU kernels of ``aten.mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` (their
  ``out=`` and in-place forms too) sum in one fixed order and ``sigmoid`` /
  ``silu`` are computed from ``exp`` (:mod:`.invariant_core`) -- the CPU
  torch references become row-invariant;
* on CUDA the same products run ``cpgraph::invariant_mm``, whose CUDA
  provider is the Triton kernel of ``cpgraph/kernels/invariant_gemm.py``
  (one config per weight shape; without Triton the binding warns and the
  fixed-order reference computes, still invariant);
* ``cpgraph::moe_experts`` / ``fp8_block_linear`` / ``mla_query`` compute as
  ``invariant_moe_experts`` / ``invariant_fp8_linear`` /
  ``invariant_mla_query`` (what the pass puts in compiled graphs), so eager
  and compiled forwards run the same kernels.

Everything else a forward runs is row-local already (docs/deterministic.md
lists it).  The replacement is a ``torch.library`` registration over the
dispatcher's kernels, undone when the outermost block exits; it applies to
every thread of the process while any block is inside.  A CUDA-graph replay
runs what its capture recorded (capture inside the mode).

:func:`fixed_order_cpu_kernels` is the CPU half alone, what the suite's
``bitexact`` tests run under (``tests/row_invariant.py``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

import torch

from . import invariant_core as core
from . import ledger

_LOCK = threading.Lock()
_STATE = {"depth": 0, "libs": None}


# ------------------------------------------------------------- CPU kernels
def _cpu_mm(a, b):
    return core.fixed_order_matmul(a, b).to(a.dtype)


def _cpu_mm_out(a, b, *, out):
    return out.copy_(core.fixed_order_matmul(a, b))


def _cpu_addmm(bias, a, b, *, beta=1, alpha=1):
    return core.scaled_sum(core.fixed_order_matmul(a, b), bias, beta, alpha).to(a.dtype)


def _cpu_addmm_out(bias, a, b, *, beta=1, alpha=1, out):
    return out.copy_(core.scaled_sum(core.fixed_order_matmul(a, b), bias, beta, alpha))


def _cpu_addmm_(bias, a, b, *, beta=1, alpha=1):
    return bias.copy_(core.scaled_sum(core.fixed_order_matmul(a, b), bias, beta, alpha))


def _unary(formula):
    def functional(x):
        return formula(x).to(x.dtype)

    def out_variant(x, *, out):
        return out.copy_(formula(x))

    def in_place(x):
        return x.copy_(formula(x))

    return functional, out_variant, in_place


def _product_kernels(mm, mm_out, addmm, addmm_out, addmm_) -> dict:
    return {"mm": mm, "mm.out": mm_out, "addmm": addmm, "addmm.out": addmm_out, "addmm_": addmm_,
            "bmm": mm, "bmm.out": mm_out, "baddbmm": addmm, "baddbmm.out": addmm_out, "baddbmm_": addmm_}


def _counted(kernel, device_type: str, implementation: str):
    """``kernel``, each call counted under ``invariant_mm`` in the provider report (what computed the products)."""

    def run(*args, **kwargs):
        ledger.ran_as("invariant_mm", device_type, implementation, "an aten product inside deterministic()")
        return kernel(*args, **kwargs)

    return run


def cpu_kernels(count: bool = False) -> dict:
    """``aten`` overload name -> row-invariant CPU kernel; ``count``: products counted in the provider report."""
    table = _product_kernels(_cpu_mm, _cpu_mm_out, _cpu_addmm, _cpu_addmm_out, _cpu_addmm_)
    if count:
        table = {name: _counted(fn, "cpu", "reference") for name, fn in table.items()}
    for name, formula in (("sigmoid", core.sigmoid_f32), ("silu", core.silu_f32)):
        table[name], table[name + ".out"], table[name + "_"] = _unary(formula)
    return table


# ------------------------------------------------------------ CUDA kernels
def _cuda_product(a, b, bias=None, beta=1, alpha=1):
    """``cpgraph::invariant_mm`` (its CUDA provider: the Triton GEMM) for floats; the fixed-order form for integers.

    Through the op, not the kernel module: the op registry binds the CUDA
    providers on first use (ops never import the kernels, tests/test_imports.py),
    and the call is counted under ``invariant_mm`` with what computed it.
    """
    if a.dtype.is_floating_point and b.dtype == a.dtype and (bias is None or beta == 0 or bias.dtype == a.dtype):
        return torch.ops.cpgraph.invariant_mm(a, b, bias if beta != 0 else None, float(beta), float(alpha))
    return core.scaled_sum(core.fixed_order_matmul(a, b), bias, beta, alpha).to(a.dtype)


def cuda_kernels() -> dict:
    """``aten`` overload name -> row-invariant CUDA kernel (products only: CUDA elementwise kernels are position-invariant)."""

    def mm(a, b):
        return _cuda_product(a, b)

    def mm_out(a, b, *, out):
        return out.copy_(_cuda_product(a, b))

    def addmm(bias, a, b, *, beta=1, alpha=1):
        return _cuda_product(a, b, bias, beta, alpha)

    def addmm_out(bias, a, b, *, beta=1, alpha=1, out):
        return out.copy_(_cuda_product(a, b, bias, beta, alpha))

    def addmm_(bias, a, b, *, beta=1, alpha=1):
        return bias.copy_(_cuda_product(a, b, bias, beta, alpha))

    return _product_kernels(mm, mm_out, addmm, addmm_out, addmm_)  # counted by the op they call


# ------------------------------------------------------------ cpgraph ops
def _stand_in(name: str):
    target = getattr(torch.ops.cpgraph, name).default

    def kernel(*args, **kwargs):
        return target(*args, **kwargs)

    kernel.__name__ = f"{name}_stand_in"
    return kernel


def op_kernels() -> dict:
    """``cpgraph`` op name -> a kernel calling its ``invariant_*`` stand-in (same schema)."""
    from . import invariant

    return {op: _stand_in(stand_in) for op, stand_in in invariant.REPLACES.items()}


# ---------------------------------------------------------------- the modes
def _register(namespace: str, table: dict, device_keys: tuple[str, ...]) -> torch.library.Library:
    lib = torch.library.Library(namespace, "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        for name, fn in table.items():
            for key in device_keys:
                lib.impl(name, fn, key)
    return lib


def _cuda_in_use() -> bool:
    return torch.cuda.is_available()


def _install() -> list:
    libs = [_register("aten", cpu_kernels(count=True), ("CPU",))]
    keys = ("CPU",)
    if _cuda_in_use():  # the CUDA products run invariant_mm, whose provider binds on first use
        libs.append(_register("aten", cuda_kernels(), ("CUDA",)))
        keys = ("CPU", "CUDA")
    libs.append(_register("cpgraph", op_kernels(), keys))
    return libs


def is_active() -> bool:
    """Whether a :func:`deterministic` block is open in this process."""
    return _STATE["depth"] > 0


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Within the block, this process computes every product row-invariantly (module docstring).

    Re-entrant and cheap to re-enter (the kernels are registered once, by
    the outermost block, and removed when it exits).
    """
    with _LOCK:
        if _STATE["depth"] == 0:
            _STATE["libs"] = _install()
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                for lib in reversed(_STATE["libs"]):
                    lib._destroy()
                _STATE["libs"] = None


def deterministic_forward(forward):
    """``forward`` run inside :func:`deterministic` on every call (an eager forward for an engine)."""

    def run(*args, **kwargs):
        with deterministic():
            return forward(*args, **kwargs)

    run.__wrapped__ = forward
    return run


@contextlib.contextmanager
def fixed_order_cpu_kernels(expect_products: bool = False) -> Iterator[None]:
    """Only the CPU half of the mode: fixed-order products and ``exp``-based sigmoid / SiLU.

    Not re-entrant-counted: each block stacks its own registration (a test
    may nest one inside the suite's autouse block).  ``expect_products``:
    fail if the block computed no product here (a forward that bypassed the
    replaced kernels would make a bit-exact comparison pass or fail by luck).
    """
    before = core.products_computed()
    lib = _register("aten", cpu_kernels(), ("CPU",))
    try:
        yield
    finally:
        lib._destroy()
    if expect_products and core.products_computed() == before:
        raise AssertionError("no matrix product ran inside the fixed-order CPU kernels: nothing was made "
                             "row-invariant")


__all__ = ["cpu_kernels", "cuda_kernels", "deterministic", "deterministic_forward", "fixed_order_cpu_kernels",
           "is_active", "op_kernels"]

"""``cpgraph.ops.invariant_mode``: what the deterministic mode replaces, that it nests, and that it leaves no trace.

Inside ``deterministic()`` the CPU products and sigmoid / SiLU are the
fixed-order ones (counted), and ``moe_experts`` / ``fp8_block_linear`` /
``mla_query`` compute as their ``invariant_*`` stand-ins (the provider
ledger names them).  After the outermost block the machine's kernels are
back.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import cpgraph.ops  # noqa: F401
from cpgraph.ops import invariant_core as core
from cpgraph.ops.invariant_mode import deterministic, deterministic_forward, fixed_order_cpu_kernels, is_active
from cpgraph.ops.providers import calls, reset_calls

ops = torch.ops.cpgraph


def test_products_are_replaced_inside_and_restored_after():
    x, w = torch.randn(9, 16), torch.randn(8, 16)
    before = core.products_computed()
    F.linear(x, w)
    assert core.products_computed() == before  # the BLAS, outside the mode
    with deterministic():
        assert is_active()
        y = F.linear(x, w)
        torch.einsum("mk,nk->mn", x, w)
        with deterministic():  # nested: the same registration, still active after the inner block
            F.linear(x, w)
        assert is_active()
        assert torch.equal(F.linear(x[3:5].clone(), w), y[3:5])
        assert torch.equal(torch.sigmoid(x), core.sigmoid(x)) and torch.equal(F.silu(x), core.silu(x))
    assert not is_active()
    assert core.products_computed() == before + 4
    F.linear(x, w)
    assert core.products_computed() == before + 4


def test_the_mode_is_process_wide_and_undone_on_error():
    seen = []
    with pytest.raises(RuntimeError, match="boom"):
        with deterministic():
            t = threading.Thread(target=lambda: seen.append((core.products_computed(),
                                                             torch.ones(2, 3) @ torch.ones(3, 4),
                                                             core.products_computed())))
            t.start()
            t.join()
            raise RuntimeError("boom")
    assert seen[0][2] == seen[0][0] + 1  # another thread's product ran the fixed-order kernel
    assert not is_active()
    before = core.products_computed()
    torch.ones(2, 3) @ torch.ones(3, 4)
    assert core.products_computed() == before


def test_cpgraph_ops_compute_as_their_invariant_stand_ins():
    g = torch.Generator().manual_seed(0)
    m, e, h, i, k = 12, 4, 16, 8, 2
    x = torch.randn(m, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    w = torch.rand(m, k, generator=g)
    gu, dn = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    reset_calls()
    with deterministic():
        got = ops.moe_experts(x, ids, w, gu, dn, None)
    assert torch.equal(got, ops.invariant_moe_experts(x, ids, w, gu, dn, None))
    ran = calls("cpu")
    assert "invariant_moe_experts" in ran and "moe_experts" not in ran, ran
    reset_calls()
    ops.moe_experts(x, ids, w, gu, dn, None)
    assert "moe_experts" in calls("cpu")


def test_deterministic_forward_wraps_every_call():
    def forward(a, b):
        assert is_active()
        return a @ b

    wrapped = deterministic_forward(forward)
    before = core.products_computed()
    wrapped(torch.ones(2, 2), torch.ones(2, 2))
    assert core.products_computed() == before + 1 and not is_active() and wrapped.__wrapped__ is forward


def test_fixed_order_cpu_kernels_fail_a_block_without_products():
    with pytest.raises(AssertionError, match="no matrix product ran"):
        with fixed_order_cpu_kernels(expect_products=True):
            torch.ones(3).sum()
    with fixed_order_cpu_kernels(expect_products=True):
        torch.ones(2, 3) @ torch.ones(3, 4)

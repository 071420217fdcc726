"""The ``cpgraph::invariant_*`` ops on CPU: opcheck, accuracy against the ops they replace, row invariance.

Row invariance is checked the way it is used: a row's bits in a product of
other row counts and offsets (``SPANS``), at other thread counts, and -- for
the experts -- with the other rows routed elsewhere.  Accuracy is checked
against the op each one replaces (or float64), to rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpgraph.ops  # noqa: F401
from cpgraph.ops.fp8_linear import FP8_MAX

ops = torch.ops.cpgraph
# FP8 operands: opcheck minus test_schema, whose mutation check multiplies inputs (no e4m3 mul on CPU);
# the inputs are checked unchanged directly (as tests/ops/test_fp8_linear.py does).
FP8_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_fp8(op, args):
    torch.library.opcheck(op, args, test_utils=FP8_CHECKS)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    op(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))
SPANS = [(0, 1), (0, 2), (3, 10), (5, 33), (1, 59), (0, 60)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows_invariant(f, x, dim=0):
    """``f`` on each span of ``x``'s rows (copied: other row counts, other offsets) equals those rows of ``f(x)``."""
    full = f(x)
    return all(torch.equal(f(x.narrow(dim, a, b - a).clone()), full.narrow(dim, a, b - a)) for a, b in SPANS)


def _at_threads(n, f):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return f()
    finally:
        torch.set_num_threads(before)


def _fp8_weight(n, k, g, block=32):
    w = (torch.randn(n, k, generator=g) * 0.5).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // block), -(-k // block), generator=g) * 0.02 + 0.005
    return w, s


def _experts(e, h, i, dtype, g):
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    down = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    return gate_up, down


def _routes(m, e, k, g):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    w = torch.rand(m, k, generator=g)
    return ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_mm_opcheck_accuracy_and_rows(dtype):
    g = _gen(0)
    x = torch.randn(60, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    v = torch.randn(3, 48, 24, generator=g).to(dtype)
    xb = torch.randn(3, 60, 48, generator=g).to(dtype)
    if dtype == torch.bfloat16:  # the schema and fake rule do not depend on the dtype: one set of checks
        for args in [(x[:9], w.t(), b, 0.5, 2.0), (xb[:, :9], v)]:
            torch.library.opcheck(ops.invariant_mm, args)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ops.invariant_mm(x, w.t(), b, 0.5, 2.0).double(),
                               (0.5 * b.double() + 2.0 * (x.double() @ w.double().t())), **tol)
    torch.testing.assert_close(ops.invariant_mm(xb, v).double(), xb.double() @ v.double(), **tol)
    assert _rows_invariant(lambda t: ops.invariant_mm(t, w.t(), b), x)
    assert _rows_invariant(lambda t: ops.invariant_mm(t, v), xb, dim=1)
    one = _at_threads(1, lambda: ops.invariant_mm(x, w.t(), b))
    assert torch.equal(one, _at_threads(4, lambda: ops.invariant_mm(x, w.t(), b)))


def test_invariant_mm_refuses_mismatched_operands():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="argument 'b'"):
        ops.invariant_mm(x, torch.randn(7, 3))
    with pytest.raises(ValueError, match="argument 'b' must have dtype"):
        ops.invariant_mm(x, torch.randn(8, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not broadcast"):
        ops.invariant_mm(x, torch.randn(8, 3), torch.randn(5))


@pytest.mark.parametrize("pow2", [False, True])
def test_invariant_fp8_linear_matches_fp8_block_linear_and_is_row_invariant(pow2):
    g = _gen(1)
    x = torch.randn(60, 96, generator=g).to(torch.bfloat16)
    w, s = _fp8_weight(80, 96, g)
    _opcheck_fp8(ops.invariant_fp8_linear, (x, w, s, 32, 32, pow2))
    got = ops.invariant_fp8_linear(x, w, s, 32, 32, pow2)
    torch.testing.assert_close(got.float(), ops.fp8_block_linear(x, w, s, 32, 32, pow2).float(), rtol=1e-2, atol=1e-2)
    assert _rows_invariant(lambda t: ops.invariant_fp8_linear(t, w, s, 32, 32, pow2), x)


@pytest.mark.parametrize("fp8", [False, True])
def test_invariant_moe_experts_matches_moe_experts_and_ignores_other_routes(fp8):
    g = _gen(2)
    m, e, h, i, k = 60, 6, 64, 32, 2
    x = (torch.randn(m, h, generator=g) * 0.5).to(torch.bfloat16)
    ids, w = _routes(m, e, k, g)
    if fp8:
        gu, gus = _fp8_weight(e * 2 * i, h, g)
        dn, dns = _fp8_weight(e * h, i, g)
        weights = (gu.view(e, 2 * i, h), dn.view(e, h, i))
        extra = (gus.view(e, 2 * i // 32, h // 32), dns.view(e, h // 32, i // 32), 32, 32, True)
    else:
        weights, extra = _experts(e, h, i, torch.bfloat16, g), ()
    num_valid = torch.tensor([50])

    def run(rows, rids, rw, nv=None):
        return ops.invariant_moe_experts(rows, rids, rw, *weights, nv, *extra)

    check = _opcheck_fp8 if fp8 else torch.library.opcheck
    check(ops.invariant_moe_experts, (x[:8], ids[:8], w[:8], *weights, num_valid, *extra))
    got = run(x, ids, w, num_valid)
    want = ops.moe_experts(x, ids, w, *weights, num_valid, *extra)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got[50:], torch.zeros_like(got[50:]))  # rows past num_valid: exact zeros
    full = run(x, ids, w)
    for a, b in SPANS:
        assert torch.equal(run(x[a:b].clone(), ids[a:b].clone(), w[a:b].clone()), full[a:b])
    # Every other row routed elsewhere (and some rows past num_valid): row 7's bits stay.
    ids2, w2 = _routes(m, e, k, _gen(3))
    ids2[7], w2[7] = ids[7], w[7]
    assert torch.equal(run(x, ids2, w2, torch.tensor([20]))[7], full[7])
    # Slot order is part of the contract: the same (expert, weight) pairs in another slot order may round
    # differently, but the combine is the fixed-order fp32 sum of the slots as given.
    y = torch.stack([ops.invariant_moe_experts(x, ids[:, j : j + 1], torch.ones(m, 1), *weights, None, *extra)
                     for j in range(k)], dim=1).float()
    acc = torch.zeros(m, h)
    for j in range(k):
        acc = acc + w[:, j : j + 1] * y[:, j]
    if not fp8:  # bf16 experts: one expert's output is rounded once, so the slot sum is reproduced exactly
        assert torch.equal(full, acc.to(torch.bfloat16))


def test_invariant_mla_query_matches_mla_query_and_is_row_invariant():
    g = _gen(4)
    m, h, nope, rope, lat = 60, 4, 16, 16, 32
    q = torch.randn(m, h, nope + rope, generator=g).to(torch.bfloat16)
    w_uk = torch.randn(h, nope, lat, generator=g).to(torch.bfloat16)
    ang = torch.rand(m, rope // 2, generator=g) * 6
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    torch.library.opcheck(ops.invariant_mla_query, (q, w_uk, cos, sin))
    got = ops.invariant_mla_query(q, w_uk, cos, sin)
    torch.testing.assert_close(got.float(), ops.mla_query(q, w_uk, cos, sin).float(), rtol=2e-2, atol=3e-2)
    for a, b in SPANS:
        sub = ops.invariant_mla_query(q[a:b].clone(), w_uk, cos[a:b].clone(), sin[a:b].clone())
        assert torch.equal(sub, got[a:b])


def test_fixed_order_sigmoid_silu_are_position_invariant():
    from cpgraph.ops import invariant_core as core

    x = torch.randn(20_000, generator=_gen(5)) * 4
    for f, ref in ((core.sigmoid, torch.sigmoid), (core.silu, F.silu)):
        torch.testing.assert_close(f(x), ref(x), rtol=1e-6, atol=1e-7)
        assert _rows_invariant(f, x)

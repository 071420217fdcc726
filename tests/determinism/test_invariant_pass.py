"""The ``use_invariant_kernels`` pass on a small module: which aten product becomes which ``invariant_mm``, refusals.

The model-graph side (counts, snapshot, numerics on the two-layer model) is
in ``test_deterministic_prefill.py``, which compiles the model once; here a
small module covers what the model does not have: a biased linear
(``addmm``), ``baddbmm`` with ``alpha`` / ``beta``, and products the pass has
no invariant form for.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch import nn

import cpgraph.ops  # noqa: F401
from cpgraph.ops.invariant_mode import deterministic
from cpgraph.passes import CPConfig, compile
from cpgraph.passes.fx_utils import normalized_graph, op_counts
from cpgraph.passes.pipeline import default_passes


class Products(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(16, 8)
        self.w = nn.Parameter(torch.randn(3, 16, 4, generator=g))
        self.c = nn.Parameter(torch.randn(3, 1, 4, generator=g))

    def forward(self, x):
        y = self.lin(x)  # addmm(bias, x, w^T)
        z = torch.baddbmm(self.c, x.expand(3, -1, -1), self.w, beta=0.5, alpha=2.0)
        return y, z, x @ self.lin.weight.t()  # mm


class MatVec(nn.Module):
    def forward(self, x, v):
        return torch.mv(x, v)


def _compile(module, cfg, graphs):
    def capture(gm, c):
        graphs.append(gm.graph)
        return gm

    return compile(module, cfg, backend="aot_eager", dynamic=False, passes=default_passes() + [("capture", capture)])


class TestInvariantPass(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_products_become_invariant_mm_and_equal_the_eager_mode(self):
        module = Products().eval()
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
        graphs = []
        fn = _compile(module, CPConfig(deterministic=True), graphs)
        got = fn(x)
        counts = op_counts(graphs[-1])
        self.assertEqual(counts["cpgraph.invariant_mm"], 3)
        self.assertEqual(sum(counts[k] for k in ("aten.mm", "aten.addmm", "aten.baddbmm", "aten.bmm")), 0)
        self.assertExpectedInline(normalized_graph(graphs[-1], keep=("cpgraph.",)), """\
v0 = cpgraph.invariant_mm(in2, _, in1, 1, 1)
v1 = cpgraph.invariant_mm(_, in4, in3, 0.5, 2)
v2 = cpgraph.invariant_mm(in2, _)""")
        with torch.no_grad(), deterministic():
            want = module(x)
        for a, b in zip(got, want):  # the same fixed-order arithmetic, bit for bit
            self.assertTrue(torch.equal(a, b))
        with torch.no_grad():
            for a, b in zip(got, module(x)):  # the machine's products: to rounding
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_a_product_without_an_invariant_form_fails_the_compile(self):
        x, v = torch.randn(4, 5), torch.randn(5)
        with pytest.raises(Exception, match="aten.mv, which has no row-invariant form"):
            _compile(MatVec(), CPConfig(deterministic=True), [])(x, v)
        torch._dynamo.reset()
        _compile(MatVec(), CPConfig(), [])(x, v)  # without deterministic the pass lets it be

"""The ops of ``cpgraph/ops/eager_numerics.py`` and ``keep_eager_numerics`` (deterministic compiles).

The ops: opcheck with dynamic shapes on several input sets, and the same bits
as ``F.rms_norm`` / ``F.layer_norm`` / the ATen function (they run ATen's
kernel).  The rewrite: on the graph Dynamo hands a backend, op counts before
/ after, a snapshot, and the rewritten graph's numerics against the
unrewritten module; through ``cpgraph.compile(deterministic=True)`` with
Inductor, the compiled module's norms and sigmoid are the ops (provider
report) and its result equals eager in the mode bit for bit.  (A default
Inductor compile of the same module differs from eager by ~5e-7: its own
reductions; measured when this test was written.)
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cpgraph.ops.eager_numerics  # noqa: F401  (registers the ops)
from cpgraph.ops import ledger
from cpgraph.passes import CPConfig, compile
from cpgraph.passes.fx_utils import op_counts
from cpgraph.ops.invariant_mode import deterministic
from cpgraph.passes.invariant_kernels import keep_eager_numerics

_cp = torch.ops.cpgraph


def _g(seed):
    return torch.Generator().manual_seed(seed)


RMS_CASES = [  # (x shape, dtype, weight?, eps)
    ((7, 32), torch.float32, True, 1e-6),
    ((2, 5, 48), torch.bfloat16, True, None),
    ((9, 16), torch.float32, False, 1e-5),
]
LAYER_CASES = [  # (x shape, dtype, weight?, bias?, eps)
    ((7, 32), torch.float32, True, True, 1e-6),
    ((3, 4, 24), torch.bfloat16, True, False, 1e-5),
    ((5, 16), torch.float32, False, False, 1e-5),
]


@pytest.mark.parametrize("shape,dtype,has_w,eps", RMS_CASES)
def test_rms_norm_op_is_aten_rms_norm_and_passes_opcheck(shape, dtype, has_w, eps):
    x = torch.randn(*shape, generator=_g(0)).to(dtype)
    w = torch.randn(shape[-1], generator=_g(1)).to(dtype) if has_w else None
    got = _cp.invariant_rms_norm(x, [shape[-1]], w, eps)
    assert torch.equal(got, F.rms_norm(x, [shape[-1]], w, eps))
    torch.library.opcheck(_cp.invariant_rms_norm.default, (x, [shape[-1]], w, eps),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("shape,dtype,has_w,has_b,eps", LAYER_CASES)
def test_layer_norm_op_is_aten_layer_norm_and_passes_opcheck(shape, dtype, has_w, has_b, eps):
    x = torch.randn(*shape, generator=_g(2)).to(dtype)
    w = torch.randn(shape[-1], generator=_g(3)).to(dtype) if has_w else None
    b = torch.randn(shape[-1], generator=_g(4)).to(dtype) if has_b else None
    got = _cp.invariant_layer_norm(x, [shape[-1]], w, b, eps)
    assert torch.equal(got, F.layer_norm(x, [shape[-1]], w, b, eps))
    torch.library.opcheck(_cp.invariant_layer_norm.default, (x, [shape[-1]], w, b, eps),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("fn", ["sigmoid", "silu", "cos", "exp"])
@pytest.mark.parametrize("shape,dtype", [((7, 33), torch.float32), ((2, 3, 16), torch.bfloat16)])
def test_eager_unary_is_the_aten_function_and_passes_opcheck(fn, shape, dtype):
    from cpgraph.ops.eager_numerics import UNARY

    x = torch.randn(*shape, generator=_g(8)).to(dtype)
    assert torch.equal(_cp.eager_unary(x, fn), UNARY[fn](x))
    torch.library.opcheck(_cp.eager_unary.default, (x, fn),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_eager_unary_names_an_unknown_function():
    with pytest.raises(ValueError, match="eager_unary: unknown function 'cbrt'"):
        _cp.eager_unary(torch.ones(2), "cbrt")


class Norms(nn.Module):
    """RMSNorm as cpgraph's models call it, an ``nn.LayerNorm`` (inlined to ``F.layer_norm``), ``sigmoid`` and ``cos`` between."""

    def __init__(self, d=32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, generator=_g(5)))
        self.ln = nn.LayerNorm(d)
        with torch.no_grad():
            self.ln.weight.copy_(torch.randn(d, generator=_g(6)))

    def forward(self, x):
        h = F.rms_norm(x, (x.shape[-1],), self.w, 1e-6)
        return self.ln(torch.sigmoid(h) * x) + torch.layer_norm(h.cos(), (h.shape[-1],), eps=1e-3)


def _names(graph):
    return sorted(n.target.__name__ if callable(n.target) and hasattr(n.target, "__name__") else str(n.target)
                  for n in graph.nodes if n.op == "call_function")


def _dynamo_graph(module, x):
    """The graph Dynamo hands a backend for ``module(x)`` (where ``keep_eager_numerics`` runs in a compile)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=capture, dynamic=False, fullgraph=True)(x)
    torch._dynamo.reset()
    return graphs[0]


class TestKeepEagerNumerics(expecttest.TestCase):
    def test_counts_snapshot_and_numerics_on_a_dynamo_graph(self):
        module = Norms().eval()
        x = torch.randn(6, 32, generator=_g(7))
        gm, inputs = _dynamo_graph(module, x)
        before = _names(gm.graph)
        self.assertEqual((before.count("rms_norm"), before.count("layer_norm"), before.count("sigmoid")), (1, 2, 1))
        with torch.no_grad():
            want = module(x)
        keep_eager_numerics(gm)
        counts = op_counts(gm.graph)
        self.assertEqual((counts["cpgraph.invariant_rms_norm"], counts["cpgraph.invariant_layer_norm"]), (1, 2))
        self.assertEqual(counts["cpgraph.eager_unary"], 2)
        self.assertNotIn("sigmoid", _names(gm.graph))
        self.assertNotIn("rms_norm", _names(gm.graph))
        self.assertNotIn("layer_norm", _names(gm.graph))
        code = "\n".join(line.strip().split(";")[0] for line in gm.code.strip().splitlines() if "cpgraph" in line)
        self.assertExpectedInline(code, """\
invariant_rms_norm_default = torch.ops.cpgraph.invariant_rms_norm.default(l_x_, (32,), l_self_parameters_w_, 1e-06)
eager_unary_default = torch.ops.cpgraph.eager_unary.default(invariant_rms_norm_default, 'sigmoid')
invariant_layer_norm_default = torch.ops.cpgraph.invariant_layer_norm.default(mul, (32,), l_self_modules_ln_parameters_weight_, l_self_modules_ln_parameters_bias_, 1e-05)
eager_unary_default_1 = torch.ops.cpgraph.eager_unary.default(invariant_rms_norm_default, 'cos')
invariant_layer_norm_default_1 = torch.ops.cpgraph.invariant_layer_norm.default(eager_unary_default_1, (32,), None, None, 0.001)""")
        with torch.no_grad():
            self.assertTrue(torch.equal(gm(*inputs)[0], want))  # the same ATen kernels, bit for bit

    def test_a_graph_without_norms_or_transcendentals_is_left_as_it_is(self):
        gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2 + x.sum(-1, keepdim=True))
        code = gm.code
        self.assertIs(keep_eager_numerics(gm), gm)
        self.assertEqual(gm.code, code)


@pytest.mark.slow
def test_deterministic_inductor_compile_runs_the_ops_and_equals_eager_bitwise():
    """Inductor would generate its own norm reductions and sigmoid (the default compile does); in the mode it must not."""
    torch._dynamo.reset()
    module = Norms().eval()
    ledger.reset()
    scalar = torch._inductor.config.patch({"cpp.vec_isa_ok": False})  # scalar C++: a faster compile, same claim
    scalar.__enter__()
    fn = compile(module, CPConfig(deterministic=True), backend="inductor", dynamic=True)
    with torch.no_grad():
        for rows in (5, 11):  # one dynamic graph, two row counts
            x = torch.randn(rows, 32, generator=_g(rows))
            with deterministic():
                want = module(x)
            assert torch.equal(fn(x), want), rows
    ran = {row["implementation"]: row["calls"] for row in ledger.calls("cpu").get("invariant_rms_norm", [])}
    assert ran.get("aten", 0) >= 2, ledger.calls("cpu")
    ran = {row["implementation"]: row["calls"] for row in ledger.calls("cpu").get("invariant_layer_norm", [])}
    assert ran.get("aten", 0) >= 4, ledger.calls("cpu")
    ran = {row["implementation"]: row["calls"] for row in ledger.calls("cpu").get("eager_unary", [])}
    assert ran.get("aten", 0) >= 4, ledger.calls("cpu")
    scalar.__exit__(None, None, None)
    torch._dynamo.reset()

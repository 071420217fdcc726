"""``share_activation_quantization``: FP8 projections that read one activation quantise it once.

Three checks, as for every rewrite pass: op counts before/after, a snapshot of the rewritten graph, and
numerics against the unrewritten graph (bit-equal: the quantisation is a function of ``x`` alone and the
GEMM half is the same function).  The model-level check (the tiny FP8 checkpoint through the whole pipeline)
is in tests/models/test_fp8_checkpoint.py, next to the checkpoint it needs.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import cpgraph.ops  # noqa: F401
import cpgraph.ops.fp8_linear  # noqa: F401
from cpgraph.passes.fx_utils import normalized_graph, op_counts
from cpgraph.passes.pipeline import default_passes
from cpgraph.passes.share_quant import share_activation_quantization

ops = torch.ops.cpgraph
FP8 = torch.float8_e4m3fn


def weights(n: int, k: int, seed: int, block=(128, 128)):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3 + 1e-4
    return w, s


def attention_inputs(m: int = 6, k: int = 256):
    """x and three projections of it (q_a-, kv_a- and wk-like: N 256, 192, 64) plus one of another tensor."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    other = torch.randn(m, 128, generator=g).to(torch.bfloat16)
    return (x, other, *weights(256, k, 1), *weights(192, k, 2), *weights(64, k, 3), *weights(96, 128, 4))


def attention_like(x, other, w1, s1, w2, s2, w3, s3, w4, s4):
    q = ops.fp8_block_linear(x, w1, s1, 128, 128, True)
    kv = ops.fp8_block_linear(x, w2, s2, 128, 128, True)
    k = ops.fp8_block_linear(x, w3, s3, 128, 128, True)
    o = ops.fp8_block_linear(other, w4, s4, 128, 128, True)  # alone on its input: left as it is
    return q.sum(-1) + kv.sum(-1) + k.sum(-1) + o.sum(-1)


def traced(fn, args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_three_projections_of_one_input_share_one_quantisation():
    args = attention_inputs()
    gm = traced(attention_like, args)
    before = op_counts(gm.graph, "cpgraph.")
    share_activation_quantization(gm)
    after = op_counts(gm.graph, "cpgraph.")
    assert before == {"cpgraph.fp8_block_linear": 4}
    assert after == {"cpgraph.fp8_block_linear": 1, "cpgraph.fp8_quantize_activations": 1,
                     "cpgraph.fp8_linear_quantized": 3}
    expecttest.assert_expected_inline(normalized_graph(gm.graph, keep=("cpgraph.", "getitem")), """\
v0 = cpgraph.fp8_quantize_activations(in0, 128, True)
v1 = getitem(v0, 0)
v2 = getitem(v0, 1)
v3 = cpgraph.fp8_linear_quantized(v1, v2, in2, in3, 128, 128, bfloat16)
v4 = cpgraph.fp8_linear_quantized(v1, v2, in4, in5, 128, 128, bfloat16)
v5 = cpgraph.fp8_linear_quantized(v1, v2, in6, in7, 128, 128, bfloat16)
v6 = cpgraph.fp8_block_linear(in1, in8, in9, 128, 128, True)""")


def test_rewritten_graph_is_bit_equal_to_the_original():
    args = attention_inputs(m=9)
    ref = traced(attention_like, args)
    gm = traced(attention_like, args)
    share_activation_quantization(gm)
    assert op_counts(gm.graph)["cpgraph.fp8_linear_quantized"] == 3
    assert torch.equal(gm(*args), ref(*args))
    # The projections themselves, not only their sums.
    x, _, w1, s1, *_ = args
    q, xs = ops.fp8_quantize_activations(x, 128, True)
    assert xs.stride() == (1, x.shape[0])  # column-major: what the SM90 GEMMs read without a copy
    assert torch.equal(ops.fp8_linear_quantized(q, xs, w1, s1, 128, 128, torch.bfloat16),
                       ops.fp8_block_linear(x, w1, s1, 128, 128, True))


def test_views_of_one_activation_count_as_one_input():
    """Each projection flattens its input with a view of its own (``FP8Linear``'s ``reshape(-1, K)``)."""
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    (w1, s1), (w2, s2) = weights(128, 256, 9), weights(64, 256, 10)

    def fn(x, w1, s1, w2, s2):
        a = ops.fp8_block_linear(x.reshape(-1, 256), w1, s1, 128, 128, True)
        b = ops.fp8_block_linear(x.reshape(-1, 256), w2, s2, 128, 128, True)
        c = ops.fp8_block_linear(x[:1].reshape(-1, 256), w2, s2, 128, 128, True)  # other rows: its own
        return a.sum() + b.sum() + c.sum()

    args = (x, w1, s1, w2, s2)
    gm, ref = traced(fn, args), traced(fn, args)
    share_activation_quantization(gm)
    assert op_counts(gm.graph, "cpgraph.") == {"cpgraph.fp8_quantize_activations": 1,
                                               "cpgraph.fp8_linear_quantized": 2, "cpgraph.fp8_block_linear": 1}
    assert torch.equal(gm(*args), ref(*args))


def test_different_recipes_are_not_merged():
    """Same input, another block_k or scale rule: different codes, so each keeps its own quantisation."""
    x = torch.randn(4, 256).to(torch.bfloat16)
    w, s = weights(128, 256, 5)
    w64, s64 = weights(128, 256, 6, block=(128, 64))

    def fn(x, w, s, w64, s64):
        return (ops.fp8_block_linear(x, w, s, 128, 128, True) + ops.fp8_block_linear(x, w, s, 128, 128, False)
                + ops.fp8_block_linear(x, w64, s64, 128, 64, True))

    gm = traced(fn, (x, w, s, w64, s64))
    share_activation_quantization(gm)
    assert op_counts(gm.graph, "cpgraph.") == {"cpgraph.fp8_block_linear": 3}


def test_a_graph_without_fp8_projections_is_left_alone():
    gm = traced(lambda x, w: torch.nn.functional.linear(x, w), (torch.randn(3, 8), torch.randn(4, 8)))
    text = normalized_graph(gm.graph)
    share_activation_quantization(gm)
    assert normalized_graph(gm.graph) == text


def test_runs_in_the_default_pipeline_after_the_invariant_rewrite():
    names = [n for n, _ in default_passes()]
    assert names.index("use_invariant_kernels") < names.index("share_activation_quantization") \
        < names.index("lower_cp_collectives")


@pytest.mark.parametrize("m", [1, 5, 130])
def test_quantised_ops_pass_opcheck(m):
    """Both ops under opcheck with dynamic shapes, minus ``test_schema`` (its mutation check multiplies the
    inputs: no e4m3 ``mul`` on CPU); that the inputs stay bit-identical is checked directly instead."""
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 200, generator=g).to(torch.bfloat16)
    torch.library.opcheck(ops.fp8_quantize_activations.default, (x, 128, True), test_utils=checks)
    torch.library.opcheck(ops.fp8_quantize_activations.default, (x.float(), 64, False), test_utils=checks)
    w, s = weights(72, 200, m)
    q, xs = ops.fp8_quantize_activations(x, 128, True)
    for args in ((q, xs, w, s, 128, 128, torch.bfloat16), (q, xs.contiguous(), w, s, 128, 128, torch.float32)):
        torch.library.opcheck(ops.fp8_linear_quantized.default, args, test_utils=checks)
        before = [t.clone() for t in args[:4]]
        ops.fp8_linear_quantized(*args)
        assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                   for a, b in zip(before, args[:4]))


def test_no_rows():
    """M = 0 (opcheck's input cloning cannot copy a 0-row column-major tensor, so it is checked here)."""
    w, s = weights(64, 256, 8)
    q, xs = ops.fp8_quantize_activations(torch.zeros(0, 256, dtype=torch.bfloat16), 128, True)
    assert q.shape == (0, 256) and xs.shape == (0, 2)
    assert ops.fp8_linear_quantized(q, xs, w, s, 128, 128, torch.bfloat16).shape == (0, 64)


def test_bad_operands_fail_with_one_line_naming_the_argument():
    x = torch.randn(4, 256).to(torch.bfloat16)
    w, s = weights(128, 256, 7)
    q, xs = ops.fp8_quantize_activations(x, 128, True)
    with pytest.raises(ValueError, match="x_scales"):
        ops.fp8_linear_quantized(q, xs[:, :1], w, s, 128, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        ops.fp8_linear_quantized(q, xs, w, s, 128, 128, torch.int32)
    with pytest.raises(ValueError, match="group"):
        ops.fp8_quantize_activations(x, 0, True)

"""``fuse_norm_into_quantization``: an FP8 projection group's quantisation done by the RMSNorm producing its input.

Three checks, as for every rewrite pass: op counts before/after, a snapshot of the rewritten graph, and numerics
against the unrewritten graph.  The graphs are written in both forms the pass meets: AOT's decomposition of
``F.rms_norm`` (``aten._to_copy`` casts; what ``backend="aot_eager"`` runs) and Inductor's (``prims`` casts, the
weight's cast placed after a reader of the residual stream).  The model-level check (the tiny FP8 checkpoint
through the whole pipeline) is in tests/models/test_fp8_checkpoint.py.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

import cpgraph.ops  # noqa: F401
from cpgraph.ops.fp8_linear import quantize_activations_reference
from cpgraph.passes import CPConfig
from cpgraph.passes.fuse_norm_quant import fuse_norm_into_quantization
from cpgraph.passes.fx_utils import normalized_graph, op_counts
from cpgraph.passes.pipeline import default_passes
from cpgraph.passes.share_quant import share_activation_quantization

ops, aten, prims = torch.ops.cpgraph, torch.ops.aten, torch.ops.prims
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
K = 256


def weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4


def layer_inputs(dtype=BF16, b=2, s=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, K, generator=g).to(dtype)
    attn = torch.randn(b, s, K, generator=g).to(dtype)
    norm_w = torch.rand(K, generator=g) + 0.5
    return (x, attn, norm_w, *weights(192, K, 1), *weights(64, K, 2))


def attention_block(x, attn, norm_w, w1, s1, w2, s2):
    """``x + attn`` -> RMSNorm -> two FP8 projections; the residual stream read on (an MLP-input-like block)."""
    x = x + attn
    h = F.rms_norm(x, (K,), norm_w.to(x.dtype), 1e-6)
    a = ops.fp8_block_linear(h.reshape(-1, K), w1, s1, 128, 128, True)
    b = ops.fp8_block_linear(h.reshape(-1, K), w2, s2, 128, 128, True)
    return x * 2, a, b


def traced(fn, args):
    """The functionalised ATen graph AOT autograd hands the pass pipeline (what ``backend="aot_eager"`` rewrites)."""
    graphs, orders = [], []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    def backend(gm, example_inputs):  # Dynamo orders the inputs by first use: remember where each came from
        orders.append([next(i for i, a in enumerate(args) if a is t) for t in example_inputs])
        return aot_autograd(fw_compiler=capture)(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    (gm,), (gm.arg_order,) = graphs, orders
    return gm


def call(gm, args):
    """Run a traced graph on the arguments of the function it was traced from."""
    order = getattr(gm, "arg_order", range(len(args)))
    return gm(*[args[i] for i in order])


def shared_then_fused(fn, args):
    gm = traced(fn, args)
    share_activation_quantization(gm)
    before = op_counts(gm.graph, "cpgraph.")
    fuse_norm_into_quantization(gm)
    return gm, before


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def close_to_unfused(got, want):
    """Within an FP8 step of the unfused graph: the fused norm's rows may differ from the unfused one's in the last
    bit of a value (another order of the squares' sum), which can move a code by one e4m3 step (2**-3)."""
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel_err(g, w) <= 2**-3, rel_err(g, w)


def test_residual_add_norm_and_quantisation_become_one_op():
    args = layer_inputs()
    gm, before = shared_then_fused(attention_block, args)
    assert before == {"cpgraph.fp8_quantize_activations": 1, "cpgraph.fp8_linear_quantized": 2}
    assert op_counts(gm.graph, "cpgraph.") == {"cpgraph.fp8_rms_norm_quantize": 1, "cpgraph.fp8_linear_quantized": 2}
    assert not op_counts(gm.graph, "aten.rsqrt")  # the unfused norm is gone
    expecttest.assert_expected_inline(normalized_graph(gm.graph, keep=("cpgraph.", "aten.reshape", "aten.mul")), """\
v0 = cpgraph.fp8_rms_norm_quantize(in0, in1, _, 1e-06, 128, True, False)
v1 = cpgraph.fp8_linear_quantized(v0[2], v0[3], in3, in4, 128, 128, bfloat16)
v2 = cpgraph.fp8_linear_quantized(v0[2], v0[3], in5, in6, 128, 128, bfloat16)
v3 = aten.mul(v0[0], 2)""")
    want = call(traced(attention_block, args), args)
    got = call(gm, args)
    assert torch.equal(got[0], want[0])  # the residual stream: one rounding of an exact sum, no freedom
    close_to_unfused(got[1:], want[1:])


def test_codes_are_those_of_the_fused_rows():
    """The projections read exactly the quantisation of the norm the op computed (the contract, by construction)."""
    x, attn, norm_w, w1, s1, *_ = layer_inputs()
    summed, normed, q, sc = ops.fp8_rms_norm_quantize(x.reshape(-1, K), attn.reshape(-1, K), norm_w.to(BF16), 1e-6,
                                                      128, True, True)
    want_q, want_sc = quantize_activations_reference(normed, 128, True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sc, want_sc)
    assert torch.equal(ops.fp8_linear_quantized(q, sc, w1, s1, 128, 128, BF16),
                       ops.fp8_block_linear(normed, w1, s1, 128, 128, True))


def inductor_form(x, attn, norm_w, w1, s1, w2, s2):
    """``attention_block`` as Inductor's decomposition writes it: prims casts, and the weight's cast after a reader
    of the residual stream (so the fused op, put before that reader, repeats the cast)."""
    s = aten.add.Tensor(x, attn)
    out = aten.mul.Tensor(s, 2)
    sf = prims.convert_element_type.default(s, torch.float32)
    rstd = aten.rsqrt.default(aten.add.Scalar(aten.mean.dim(aten.pow.Tensor_Scalar(sf, 2), [2], True), 1e-6))
    normed = aten.mul.Tensor(sf, rstd)
    wc = prims.convert_element_type.default(norm_w, BF16)
    h = prims.convert_element_type.default(aten.mul.Tensor(normed, wc), BF16)
    q, sc = ops.fp8_quantize_activations(aten.reshape.default(h, [-1, K]), 128, True)
    return (out, ops.fp8_linear_quantized(q, sc, w1, s1, 128, 128, BF16),
            ops.fp8_linear_quantized(q, sc, w2, s2, 128, 128, BF16))


def test_inductor_form_with_the_weight_cast_after_a_residual_reader():
    args = layer_inputs()
    gm = make_fx(inductor_form, tracing_mode="fake")(*args)
    before = op_counts(gm.graph, "prims.")
    fuse_norm_into_quantization(gm)
    counts = op_counts(gm.graph)
    assert counts["cpgraph.fp8_rms_norm_quantize"] == 1 and not counts["cpgraph.fp8_quantize_activations"]
    assert before["prims.convert_element_type"] == 3 and counts["prims.convert_element_type"] == 1  # the repeat
    got, want = call(gm, args), inductor_form(*args)
    assert torch.equal(got[0], want[0])
    close_to_unfused(got[1:], want[1:])


def q_latent_block(x, norm_w, w1, s1):
    """A norm with no residual add read by one projection (V3.2's q_a_layernorm -> q_b when wq_b is dense)."""
    h = F.rms_norm(x, (K,), norm_w.to(x.dtype), 1e-6)
    return ops.fp8_block_linear(h, w1, s1, 128, 128, False)


def test_norm_without_residual_and_a_lone_projection():
    x, _, norm_w, w1, s1, *_ = layer_inputs()
    args = (x.reshape(-1, K), norm_w, w1, s1)
    gm, before = shared_then_fused(q_latent_block, args)
    assert before == {"cpgraph.fp8_block_linear": 1}
    assert op_counts(gm.graph, "cpgraph.") == {"cpgraph.fp8_rms_norm_quantize": 1, "cpgraph.fp8_linear_quantized": 1}
    expecttest.assert_expected_inline(normalized_graph(gm.graph, keep=("cpgraph.",)), """\
v0 = cpgraph.fp8_rms_norm_quantize(in1, None, _, 1e-06, 128, False, False)
v1 = cpgraph.fp8_linear_quantized(v0[2], v0[3], in2, in3, 128, 128, bfloat16)""")
    close_to_unfused(call(gm, args), call(traced(q_latent_block, args), args))


def hidden_read_by_a_dense_layer(x, attn, norm_w, w1, s1, w2, s2, dense):
    """The normed rows also feed a bf16/fp32 layer (the indexer's weights_proj): the op must hand them out."""
    x = x + attn
    h = F.rms_norm(x, (K,), norm_w.to(x.dtype), 1e-6)
    a = ops.fp8_block_linear(h.reshape(-1, K), w1, s1, 128, 128, True)
    b = ops.fp8_block_linear(h.reshape(-1, K), w2, s2, 128, 128, True)
    return x, a, b, F.linear(h.float(), dense)


def test_normed_rows_kept_for_another_reader():
    args = (*layer_inputs(), torch.randn(8, K))
    gm, _ = shared_then_fused(hidden_read_by_a_dense_layer, args)
    fused = [n for n in gm.graph.nodes if n.target is ops.fp8_rms_norm_quantize.default]
    assert len(fused) == 1 and fused[0].args[-1] is True  # emit_normed
    got, want = call(gm, args), call(traced(hidden_read_by_a_dense_layer, args), args)
    assert torch.equal(got[0], want[0])
    close_to_unfused(got[1:3], want[1:3])
    assert rel_err(got[3], want[3]) <= 2**-7  # the dense layer reads the op's normed rows (one bf16 rounding apart)


def not_fusable(x, attn, norm_w, w1, s1, w2, s2):
    """A projection of a plain activation, a norm written out by hand (x / sqrt(...)), and transformers' form
    (rounded to the activation dtype before the weight: another arithmetic) are not rewritten."""
    plain = ops.fp8_block_linear((x + attn).reshape(-1, K), w1, s1, 128, 128, True)
    xf = x.float()
    h = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w).to(x.dtype)
    hf = norm_w.to(x.dtype) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return (plain, ops.fp8_block_linear(h.reshape(-1, K), w2, s2, 128, 128, True),
            ops.fp8_block_linear(hf.reshape(-1, K), w2, s2, 128, 128, True))


def test_other_inputs_are_left_alone():
    gm = traced(not_fusable, layer_inputs())
    assert op_counts(gm.graph, "cpgraph.") == {"cpgraph.fp8_block_linear": 3}
    text = normalized_graph(gm.graph)
    fuse_norm_into_quantization(gm)
    assert normalized_graph(gm.graph) == text


def test_a_broadcast_add_is_not_taken_for_a_residual():
    """``x + bias`` feeds the norm but is not a residual add of two rows: the op gets the sum as its input."""
    def fn(x, bias, norm_w, w1, s1):
        return ops.fp8_block_linear(F.rms_norm(x + bias, (K,), norm_w.to(x.dtype), 1e-6), w1, s1, 128, 128, True)

    x, attn, norm_w, w1, s1, *_ = layer_inputs()
    args = (x.reshape(-1, K), attn[0, 0], norm_w, w1, s1)
    gm = traced(fn, args)
    fuse_norm_into_quantization(gm)
    fused = [n for n in gm.graph.nodes if n.target is ops.fp8_rms_norm_quantize.default]
    assert len(fused) == 1 and fused[0].args[1] is None
    close_to_unfused(call(gm, args), call(traced(fn, args), args))


def test_deterministic_compile_is_left_alone():
    gm = traced(attention_block, layer_inputs())
    share_activation_quantization(gm)
    text = normalized_graph(gm.graph)
    fuse_norm_into_quantization(gm, CPConfig(deterministic=True))
    assert normalized_graph(gm.graph) == text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_activation_dtypes(dtype):
    """fp32 activations: torch's decomposition has no casts at all; fp16: casts as for bf16."""
    args = layer_inputs(dtype)
    gm, _ = shared_then_fused(attention_block, args)
    assert op_counts(gm.graph, "cpgraph.")["cpgraph.fp8_rms_norm_quantize"] == 1
    got, want = call(gm, args), call(traced(attention_block, args), args)
    assert torch.equal(got[0], want[0])
    close_to_unfused(got[1:], want[1:])


def test_dynamic_shapes_need_no_symbolic_reshape(recwarn):
    """Compiled with dynamic sizes: the op takes the norm's ``[batch, seq, K]`` input as it is, so the rewrite puts
    no raw SymInt into the graph (FX warns about those), and two batch shapes run from one graph."""
    from cpgraph.passes import compile

    torch._dynamo.reset()
    fn = compile(attention_block, backend="aot_eager", dynamic=True)
    for b, s in ((2, 5), (3, 7)):
        args = layer_inputs(b=b, s=s)
        got = fn(*args)
        want = attention_block(*args)
        assert torch.equal(got[0], want[0])
        close_to_unfused(got[1:], want[1:])
    torch._dynamo.reset()
    assert fn.cpgraph_passes.counts_after("fuse_norm_into_quantization")["cpgraph.fp8_rms_norm_quantize"] == 1
    assert not [w for w in recwarn if "SymInt" in str(w.message)]


def test_runs_in_the_default_pipeline_after_sharing():
    names = [n for n, _ in default_passes()]
    assert names.index("share_activation_quantization") < names.index("fuse_norm_into_quantization") \
        < names.index("lower_cp_collectives") < names.index("eliminate_dead_code")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_on_cuda_runs_the_fused_kernel_and_stays_close():
    """On a GPU through Inductor: the fused op is in the compiled graph, its Triton provider computed it (the
    provider report), and the outputs stay within an FP8 step of the same compile without the pass."""
    from cpgraph.ops.providers import reset_calls, selected
    from cpgraph.passes import compile

    args = tuple(t.cuda() for t in layer_inputs(b=4, s=96))
    outs = {}
    for disabled in ((), ("fuse_norm_into_quantization",)):
        torch._dynamo.reset()
        reset_calls()
        fn = compile(attention_block, CPConfig(disabled_passes=disabled), backend="inductor")
        outs[disabled] = fn(*args)
        if not disabled:
            assert fn.cpgraph_passes.counts_after("fuse_norm_into_quantization")["cpgraph.fp8_rms_norm_quantize"] == 1
            assert selected("cuda").get("fp8_rms_norm_quantize") == "triton", selected("cuda")
    torch._dynamo.reset()
    fused, plain = outs[()], outs[("fuse_norm_into_quantization",)]
    assert torch.equal(fused[0], plain[0])
    close_to_unfused(fused[1:], plain[1:])

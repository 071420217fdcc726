"""benchmarks/production_shape.py on CPU: its configs, FLOP formula, kernel classes, layer split and projection.

The GPU run has little device time, so what can be checked without a GPU is checked here: the
released sizes it builds (against tests/models/test_real_configs.py), the FLOP parts (against
independent arithmetic), the profile's name patterns, the per-layer marker split and the
projection arithmetic, on-device random init and the in-place FP8 conversion, and the dry run's
smallest configuration end to end (one model, bf16 weights and KV, one case: about 4 s).  The
full dry run (every variant and case kind, a few minutes) is the command in the script's
docstring.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "models"))

import production_shape as ps  # noqa: E402
import test_real_configs as real_configs  # noqa: E402


def test_released_configs_match_the_tested_ones():
    want_v32 = {k: v for k, v in real_configs.DEEPSEEK_V32.items() if k != "quantization_config"}
    assert ps.DEEPSEEK_V32 == want_v32
    assert ps.GLM5 == real_configs.GLM5
    assert {**ps.GLM5, **ps.GLM5_INDEXCACHE} == real_configs.GLM5_INDEXCACHE
    glm = ps.real_config("glm5")
    assert (glm.num_hidden_layers, len(glm.indexer_layers)) == (78, 21)
    assert ps.real_config("v32").num_hidden_layers == 61


@pytest.mark.parametrize("layers", [2, 3, 4])
def test_bench_stack_has_every_layer_kind(layers):
    v32 = ps.bench_config("v32", layers, tiny=False)
    assert v32.mlp_layer_types == ("dense",) + ("sparse",) * (layers - 1)
    assert set(v32.indexer_types) == {"full"} and v32.hidden_size == 7168 and v32.n_routed_experts == 256
    glm = ps.bench_config("glm5", layers, tiny=False)
    assert glm.indexer_types[0] == "full" and "shared" in glm.indexer_types  # IndexCache: a shared layer
    assert glm.mlp_layer_types[0] == "dense" and glm.hidden_size == 6144
    with pytest.raises(ValueError, match="--layers"):
        ps.bench_config("v32", 5, tiny=False)


def test_flop_parts_match_independent_arithmetic():
    cfg = ps.real_config("v32")
    S, k = 32768, 2048
    parts = ps.flops_parts(cfg, 1, S, 0)  # raises unless the parts sum to vs_transformers.forward_flops
    selected = k * (k + 1) // 2 + (S - k) * k  # sum over tokens of min(window, k)
    assert parts["sparse_mla"] == pytest.approx(61 * selected * 2 * 128 * (512 + 64 + 512), rel=1e-12)
    assert parts["indexer_logits"] == pytest.approx(61 * S * (S + 1) / 2 * 2 * 64 * 128, rel=1e-12)
    assert parts["routed_experts"] == pytest.approx(58 * S * 8 * 6 * 7168 * 2048, rel=1e-12)
    assert parts["dense_mlp"] == pytest.approx(3 * S * 6 * 7168 * 18432, rel=1e-12)
    glm = ps.real_config("glm5")
    gparts = ps.flops_parts(glm, 8, 4096, 0)
    windows = 8 * 4096 * 4097 / 2  # eight requests, each its own causal window
    assert gparts["indexer_logits"] == pytest.approx(21 * windows * 2 * 32 * 128, rel=1e-12)  # IndexCache: 21 layers


@pytest.mark.parametrize("name,category", [
    ("_sparse_mla_kernel", "sparse attention"),
    ("void flash::sm90::sparse_attn_fwd_kernel<...>", "sparse attention"),
    ("_select_kernel", "indexer select"),
    ("_score_kernel", "indexer score"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<...>>>",
     "routed experts"),
    ("_grouped_gemm_kernel", "routed experts"),
    ("triton_poi_fused__to_copy_cat_mul_stack_sub_7", "query assembly"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NTT", "dense linears"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "dense linears"),
    ("_quantize_kernel", "dense linears"),
    ("_rms_norm_quantize_kernel", "dense linears"),  # the add + norm that quantises for the FP8 projections
    ("_mm_kernel", "dense linears"),  # deterministic mode's invariant GEMM
    ("_grouped_kernel", "routed experts"),  # and its grouped experts
    ("_moe_route_kernel", "other"),  # the router's selection (cpgraph::moe_route)
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
    ("_mla_fp8_pack_kernel", "other"),
    ("some_new_kernel_nobody_named", "unclassified"),
])  # fmt: skip
def test_kernel_names_fall_into_their_categories(name, category):
    assert ps.classify(name) == category


def test_breakdown_sums_and_keeps_unclassified_names():
    rows = [("_select_kernel", 6.0, 2), ("_score_kernel", 3.0, 2), ("mystery", 1.0, 1)]
    out = ps.breakdown(rows, {"indexer_logits": 3e12})
    cats = out["categories"]
    assert out["gpu_busy_ms"] == 10.0 and cats["indexer select"]["share"] == pytest.approx(0.6)
    assert cats["indexer score"]["tflops"] == pytest.approx(3e12 / 3e-3 / 1e12)
    assert cats["unclassified"]["top"][0]["kernel"] == "mystery"


def _marker_fn(order):
    pool = torch.zeros(1)

    def fn():
        for kind, layer in order:
            getattr(torch.ops.cpgraph, f"kv_layer_{kind}")(pool, layer)

    return fn


def test_layer_segments_follow_the_markers_and_refuse_a_reordered_graph():
    ps.vt.DEVICE = "cpu"
    good = ps.layer_segments(_marker_fn([("ready", 0), ("written", 0), ("ready", 1), ("written", 1)]), 2)
    assert good["ok"] and len(good["kv_write_indexer_ms"]) == len(good["attention_mlp_ms"]) == 2
    assert good["pre_ms"] + sum(good["kv_write_indexer_ms"]) + sum(good["attention_mlp_ms"]) == pytest.approx(
        good["total_ms"])
    bad = ps.layer_segments(_marker_fn([("ready", 0), ("ready", 1), ("written", 0), ("written", 1)]), 2)
    assert not bad["ok"] and "out of order" in bad["why"]


def test_projection_composes_layer_kinds():
    cfg = ps.bench_config("glm5", 2, tiny=True)  # layer 0 dense/full, layer 1 MoE/shared
    real = ps.real_config("glm5")  # 3 dense/full, 18 MoE/full, 57 MoE/shared
    seg = {"ok": True, "pre_ms": 3.0, "kv_write_indexer_ms": [10.0, 1.0], "attention_mlp_ms": [20.0, 40.0]}
    case = ps.Case("32K", 1, 32768)
    p = ps.project(cfg, real, seg, once=2.0, case=case, measured_ms=74.0)
    moe_rest = 40.0 + 3.0 - 2.0  # the last layer's segment plus its q/kv part (in pre), less the once-only parts
    want = {"dense/full": 20.0 + 10.0, "sparse/full": moe_rest + 10.0, "sparse/shared": moe_rest + 1.0}
    assert p["kind_ms"] == pytest.approx(want)
    total = 2.0 + 3 * want["dense/full"] + 18 * want["sparse/full"] + 57 * want["sparse/shared"]
    assert p["full_model_s"] == pytest.approx(total / 1e3)
    assert p["cp8_ideal_latency_s"] == pytest.approx(total / 8e3)
    assert p["cp8_ideal_tokens_per_s_per_gpu"] == pytest.approx(32768 / (total / 1e3))
    assert "PROJECTION" in p["label"]
    assert "skipped" in ps.project(cfg, real, {"ok": False, "why": "x"}, 2.0, case, 74.0)


@torch.no_grad()
def test_random_model_on_device_and_fp8_in_place():
    ps.vt.DEVICE = "cpu"
    cfg = ps.bench_config("v32", 2, tiny=True)
    a = ps.build_random_model(cfg, torch.device("cpu"), seed=3)
    b = ps.build_random_model(cfg, torch.device("cpu"), seed=3)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
        assert torch.isfinite(p.float()).all(), name
    assert a.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert a.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert a.model.layers[0].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    w = a.model.layers[1].mlp.experts.gate_up_proj
    assert w.float().std().item() == pytest.approx(cfg.hidden_size**-0.5, rel=0.1)
    inv = a.model.rotary.inv_freq
    assert torch.isfinite(inv).all() and inv[0].item() == pytest.approx(1.0)
    ref_q_b = a.model.layers[0].self_attn.q_b_proj.weight.float().clone()
    ref_up = a.model.layers[1].mlp.experts.gate_up_proj.float().clone()
    info = ps.to_fp8_weights_(a)
    from cpgraph.models.fp8 import FP8Linear
    from cpgraph.models.moe import FP8Experts
    from cpgraph.ops.fp8_linear import dequantize_weight

    attn = a.model.layers[0].self_attn
    assert isinstance(attn.q_b_proj, FP8Linear) and isinstance(attn.indexer.wk, FP8Linear)
    assert type(attn.kv_b_proj) is torch.nn.Linear and type(attn.indexer.weights_proj) is torch.nn.Linear
    experts = a.model.layers[1].mlp.experts
    assert isinstance(experts, FP8Experts) and info["fp8_expert_stacks"] == 1
    got = dequantize_weight(attn.q_b_proj.weight, attn.q_b_proj.weight_scale_inv, 128, 128)
    assert ((got - ref_q_b).norm() / ref_q_b.norm()).item() < 0.05
    got_up = dequantize_weight(experts.gate_up_proj[0], experts.gate_up_proj_scale_inv[0], 128, 128)
    assert ((got_up - ref_up[0]).norm() / ref_up[0].norm()).item() < 0.05


def test_memory_plan_books_the_experts_that_ran():
    """The case's plan names the ``moe_experts`` implementation whose provider-report count grew during the case."""
    from cpgraph.plan.memory import EXPERTS_PROVIDERS

    def report(**n):
        rows = [{"implementation": k, "calls": v, "reason": None} for k, v in n.items()]
        rows.append({"implementation": "triton", "calls": 1, "reason": "CPGRAPH_FP8_EXPERTS=triton"})
        return {"moe_experts": rows, "sparse_mla": [{"implementation": "flash_mla", "calls": 99, "reason": None}]}

    earlier = report(triton=40)  # an earlier variant's bf16 experts
    assert ps._experts_ran(earlier, report(triton=40, deep_gemm=6)) == "deep_gemm"
    assert ps._experts_ran(earlier, report(triton=46, deep_gemm=2)) == "triton"
    assert ps._experts_ran(earlier, earlier) is None and ps._experts_ran({}, {}) is None
    assert set(EXPERTS_PROVIDERS) >= {"deep_gemm", "triton"}


@pytest.mark.slow
def test_smallest_dry_run_end_to_end(tmp_path, capfd):
    """``--device cpu`` at its smallest: every step runs and the JSON holds each figure the GPU run reports."""
    out = tmp_path / "dry.json"
    threads = torch.get_num_threads()
    assert ps.main(["--device", "cpu", "--variants", "bf16/bf16", "--cases", "8K", "--repeat", "1", "--profile",
                    "--replay", "indexer_topk,indexer_logits_fp8", "--replay-rest", "0", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the dry run's single thread is given back
    import json

    data = json.loads(out.read_text())
    (row,) = data["cases"]
    assert "skipped" not in row and row["best_mode"] in ("compiled", "graphed")
    assert row["modes"]["compiled"]["graphs_compiled"] == 1  # one compile for the (variant, shape)
    assert row["modes"]["graphed"]["graphs_compiled"] == 0  # the graph replays that compiled forward
    assert row["modes"]["graphed"]["max_abs_diff_vs_compiled"] == 0.0
    assert row["forward_tflop"] * 1e12 == pytest.approx(sum(row["flops_parts_tflop"].values()) * 1e12)
    seg = row["layer_segments"]
    assert seg["ok"] and len(seg["kv_write_indexer_ms"]) == 2
    proj = row["projection"]
    assert proj["layers"] == 61 and proj["full_model_s"] > 0 and set(proj["kind_ms"]) == {"dense/full", "sparse/full"}
    logged = capfd.readouterr()
    assert "8K projection (61 layers): " in logged.out + logged.err  # logged as it comes, before the tables
    cats = row["profile"]["categories"]
    assert {"sparse attention", "dense linears"} <= set(cats)
    assert row["memory_plan"]["total"] > 0 and row["share_of_bf16_gemm"] > 0
    assert row["memory_plan"]["experts_provider"] in ("triton", "reference")  # bf16 experts (tiny: maybe unaligned)
    assert data["meta"]["gemm"]["fp8_blockwise_skipped"] == "not a CUDA tensor"
    # The forward's first indexer call replayed on its own arguments (the reference on CPU), both ways.
    rep = row["replay"]["indexer_topk"]
    assert rep["recorded"] == 1 and rep["implementation"] == "reference"
    assert len(rep["rested"]["samples"]) == 1 and len(rep["after_forward"]["samples"]) == 1
    assert rep["rested"]["ms"] > 0 and "gpu" not in rep["rested"]  # no clocks on CPU
    assert row["replay"]["indexer_logits_fp8"] == {"op": "indexer_logits_fp8", "recorded": 0,
                                                   "why": "the forward made no indexer_logits_fp8 call on cpu"}

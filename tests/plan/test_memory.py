"""The memory plan: weights equal what the model allocates, KV equals what the pool allocates, real configs add up."""

from __future__ import annotations

import json

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import tiny_model
from cpgraph.models.config import DSAConfig, bundled_config_dict, bundled_names
from cpgraph.models.loading import build_model, estimate_model_bytes
from cpgraph.ops import codecs
from cpgraph.plan import plan_prefill
from cpgraph.plan import memory as mem

# Public config.json values (architecture sizes only; no weights).
DEEPSEEK_V32 = dict(
    model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
    index_n_heads=64, index_head_dim=128, index_topk=2048,
)
# GLM-5 (zai-org/GLM-5, transformers' GlmMoeDsaConfig): 78 layers, 3 dense; no IndexCache keys (every layer indexes).
GLM5 = dict(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, first_k_dense_replace=3, num_attention_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
    index_n_heads=32, index_head_dim=128, index_topk=2048,
)


def _cfg(d: dict) -> DSAConfig:
    return DSAConfig.from_hf_dict(d)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name", bundled_names())
@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_weights_equal_what_the_model_allocates(name, dtype, torch_dtype):
    cfg = _cfg(bundled_config_dict(name))
    assert sum(mem.weight_bytes(cfg, dtype).values()) == estimate_model_bytes(cfg, torch_dtype)
    assert mem.param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_weight_parts_follow_the_modules():
    """Each part equals the bytes of the modules it names (tiny-glm5 in fp32; IndexCache drops indexers)."""
    model = tiny_model("tiny-glm5")
    cfg = model.config

    def nbytes(pred):
        named = dict(model.named_parameters()) | dict(model.named_buffers())
        return sum(t.numel() * t.element_size() for n, t in named.items() if pred(n))

    parts = mem.weight_bytes(cfg, "fp32")
    assert parts["indexer"] == nbytes(lambda n: ".indexer." in n and "k_norm" not in n)
    assert parts["routed_experts"] == nbytes(lambda n: ".mlp.experts." in n)
    assert parts["shared_experts"] == nbytes(lambda n: "shared_experts" in n)
    assert parts["router"] == nbytes(lambda n: ".mlp.gate." in n)
    assert parts["embeddings"] == nbytes(lambda n: "embed_tokens" in n or "lm_head" in n)
    assert len(cfg.indexer_layers) < cfg.num_hidden_layers  # the check above covers the IndexCache case


def test_expert_parallelism_splits_only_the_routed_experts():
    cfg = _cfg(DEEPSEEK_V32)
    one, eight = mem.weight_bytes(cfg, "bf16", ep=1), mem.weight_bytes(cfg, "bf16", ep=8)
    assert eight["routed_experts"] * 8 == one["routed_experts"]
    assert {k: v for k, v in eight.items() if k != "routed_experts"} == {
        k: v for k, v in one.items() if k != "routed_experts"}
    with pytest.raises(ValueError, match="'ep' = 3 does not divide the 256 routed experts"):
        mem.weight_bytes(cfg, "bf16", ep=3)


@pytest.mark.parametrize("name", ["tiny-glm5", "tiny-deepseek-v32"])
def test_expert_shard_equals_what_an_ep_rank_allocates(name):
    from cpgraph.models import moe

    cfg = _cfg(bundled_config_dict(name))
    for ep in (2, 4):
        for rank in (0, ep - 1):
            with moe.expert_shard(moe.local_expert_range(cfg.n_routed_experts, rank, ep)):
                built = estimate_model_bytes(cfg, torch.float32)
            assert sum(mem.weight_bytes(cfg, "fp32", ep=ep).values()) == built


def test_fp8_weights_are_e4m3_with_block_scales():
    cfg = _cfg(DEEPSEEK_V32)
    bf16, fp8 = mem.weight_bytes(cfg, "bf16"), mem.weight_bytes(cfg, "fp8")
    # A routed expert: three 7168 x 2048 matrices, 1 byte per value + one fp32 per 128 x 128 block.
    per_expert = 3 * (7168 * 2048 + 4 * 56 * 16)
    assert fp8["routed_experts"] == 58 * 256 * per_expert
    assert fp8["embeddings"] == bf16["embeddings"] and fp8["router"] == bf16["router"]  # kept as they are


def test_real_configs_have_their_published_sizes():
    # DeepSeek-V3.2: 671B main-model parameters (685B with the MTP layer, which prefill does not load).
    assert mem.param_count(_cfg(DEEPSEEK_V32)) == pytest.approx(671e9, rel=0.01)
    # GLM-5: 744B total parameters.
    assert mem.param_count(_cfg(GLM5)) == pytest.approx(744e9, rel=0.01)


# ----------------------------------------------------------------------------- KV


def test_byte_facts_match_the_codecs():
    assert mem.MLA_FP8_RECORD_BYTES == codecs.MLA_FP8_RECORD_BYTES == 656
    cfg = _cfg(DEEPSEEK_V32)
    per_tok = mem.kv_bytes_per_token(cfg, "fp8")
    assert per_tok == {"mla": 61 * 656, "index": 61 * codecs.index_k_token_bytes(128)}
    assert codecs.index_k_token_bytes(128) == 132
    assert mem.kv_bytes_per_token(cfg, "bf16", dtype="bf16") == {"mla": 61 * 1152, "index": 61 * 256}


def test_index_k_only_for_layers_with_their_own_indexer():
    glm = _cfg(dict(GLM5, index_topk_freq=4, index_skip_topk_offset=2))
    active = len(glm.indexer_layers)
    assert 0 < active < 78
    assert mem.kv_bytes_per_token(glm, "fp8")["index"] == active * 132
    assert mem.weight_bytes(glm, "bf16")["indexer"] * 78 == mem.weight_bytes(_cfg(GLM5), "bf16")["indexer"] * active


@pytest.mark.parametrize("tokens,cp,page", [(131072, 8, 64), (1000, 2, 64), (97, 4, 16), (5000, 3, 32), (10, 8, 16)])
def test_owned_pages_follow_the_planner(tokens, cp, page):
    plan = plan_prefill([0], [tokens], cp_size=cp, page_size=page)
    owners = plan.page_owners(0)
    assert mem.owned_pages(tokens, cp, page) == (max(owners.count(r) for r in range(cp)), len(owners))


@pytest.mark.parametrize("name,kv_format", [("tiny-deepseek-v32-fp8", "fp8"), ("tiny-deepseek-v32-fp8", "bf16"),
                                            ("tiny-glm5", "bf16")])
def test_kv_bytes_equal_what_the_pool_allocates(name, kv_format):
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill

    model = tiny_model(name)
    model.kv_layout = make_layout(model, kv_format, 16)
    prompt = [list(range(3, 3 + 70))]
    res = run_prefill(lambda *a, **k: model(*a, **k), model, prompt, kv_format=kv_format, page_size=16)
    plan = mem.plan_memory(model.config, tokens=70, page_size=16, dtype="fp32", kv_format=kv_format)
    assert plan.kv_bytes == res.kv_bytes == res.pool_bytes


def test_v32_and_glm5_at_cp8_ep8_128k():
    for d, layers, index_layers in ((DEEPSEEK_V32, 61, 61), (GLM5, 78, 78)):
        plan = mem.plan_memory(_cfg(d), tokens=131072, cp=8, ep=8, dtype="fp8", kv_format="fp8")
        assert (plan.pages_per_rank, plan.pages_total) == (256, 2048)  # 2048 pages, 16 chunks of 128
        assert plan.kv_bytes == 256 * 64 * (layers * 656 + index_layers * 132)
        assert plan.kv_replicated_bytes == 8 * plan.kv_bytes
        assert plan.rows == 16384 and plan.keys == 131072
        assert plan.total_bytes == plan.weight_bytes + plan.kv_bytes + plan.activation_peak


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_indexer_scores_are_chunked(kv_format):
    """Both index-K formats score a byte-budgeted chunk of rows: only the N-sized views grow with the keys."""
    cfg = _cfg(DEEPSEEK_V32)
    small, big = (mem.plan_memory(cfg, tokens=t, cp=8, row_bucket=4096, kv_format=kv_format) for t in (65536, 131072))
    grow = big.activation_phases["attention"] - small.activation_phases["attention"]
    assert grow < 4096 * 65536  # an unchunked fp32 [rows, keys] would grow by 4 * 4096 * 65536
    # ... and the score chunk is what the budget sets: a 16x budget makes it the attention phase's peak
    # (with the select kernel's candidate scratch beside it: N / 8 int32 columns per fp32 row of N keys).
    wide = mem.plan_memory(cfg, tokens=131072, cp=8, row_bucket=4096, kv_format=kv_format,
                           max_logits_bytes=16 * mem.DEFAULT_MAX_LOGITS_BYTES)
    extra = wide.activation_phases["attention"] - big.activation_phases["attention"]
    assert 0 < extra <= 15 * mem.DEFAULT_MAX_LOGITS_BYTES * 9 // 8


def test_moe_and_mlp_phases_scale_with_the_row_bucket():
    cfg = _cfg(GLM5)
    # The grouped path: DeepGEMM's padding (128 E rows, the default's) does not scale with the rows.
    a, b = (mem.plan_memory(cfg, tokens=131072, cp=8, row_bucket=r, experts_provider="triton") for r in (2048, 4096))
    assert b.activation_phases["dense_mlp"] == 2 * a.activation_phases["dense_mlp"]
    # ... all but the experts' group ends (int32 [E]), whatever the rows
    assert b.activation_phases["moe"] == 2 * a.activation_phases["moe"] - mem._block(4 * cfg.n_routed_experts)
    assert b.activation_base == 2 * a.activation_base


def test_expert_parallel_adds_static_capacity_buffers():
    """EP's dispatch holds ``ep * rows * min(top_k, E/ep)`` wire rows whatever the routing; only the MoE phase grows."""
    cfg = _cfg(DEEPSEEK_V32)
    one, eight = (mem.plan_memory(cfg, tokens=131072, cp=8, ep=ep, row_bucket=4096) for ep in (1, 8))
    wire_rows = 8 * 4096 * min(8, 256 // 8)
    # received rows, their expert-sorted copy, the expert outputs and the combine's returned rows: [n, hidden] each
    assert eight.activation_phases["moe"] - one.activation_phases["moe"] >= 4 * wire_rows * 7168 * 2
    for phase in ("attention", "sparse_mla", "dense_mlp"):
        assert eight.activation_phases[phase] == one.activation_phases[phase]
    assert eight.peak_phase == "moe"


def test_previous_layers_topk_stays_live():
    """The model's loop holds layer i-1's top-k while layer i computes its own: two [rows, topk] int32 buffers."""
    import dataclasses

    cfg = _cfg(DEEPSEEK_V32)
    shared = dataclasses.replace(cfg, indexer_types=("full",) + ("shared",) * (cfg.num_hidden_layers - 1))
    own = mem.activation_phases(cfg, 4096, 65536)[1]
    reuse = mem.activation_phases(shared, 4096, 65536)[1]
    assert own["moe"] - reuse["moe"] == 4 * 4096 * 2048  # a shared layer's top-k IS the previous one


def test_tape_counts_allocator_blocks():
    tape = mem._Tape()
    tape.alloc("a", 1)  # one 512-byte block
    tape.alloc("b", 1024)
    tape.free("a")
    tape.new_phase()
    tape.alloc("c", 513)
    assert (tape.cur, tape.peak) == (1024 + 1024, 1024 + 1024)
    tape.free("b", "c")
    assert tape.cur == 0 and tape.peak == 2048


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures the CUDA caching allocator")
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_activation_peak_matches_cuda_allocator(kv_format):
    """The eager plan against ``max_memory_allocated`` of a prefill of the kernel-shaped model (H200: within 0.2%)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from memory_check import kernel_shaped_model

    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill

    dev = torch.device("cuda")
    model = kernel_shaped_model(dev)
    model.kv_layout = make_layout(model, kv_format, 64)
    prompt = [list(range(3, 3 + 2048))]

    def run():
        return run_prefill(lambda *a, **k: model(*a, **k), model, prompt, kv_format=kv_format, page_size=64)

    run()  # one-time workspaces (cuBLAS, Triton autotuning) are no activation
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    res = run()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - start - res.pool_bytes
    plan = mem.plan_memory(model.config, tokens=2048, kv_format=kv_format, page_size=64)
    assert plan.kv_bytes == res.pool_bytes
    assert measured == pytest.approx(plan.activation_peak, rel=0.1)


@pytest.mark.parametrize("kw,msg", [
    (dict(tokens=0), "'tokens' must be an int >= 1"),
    (dict(tokens=10, page_size=48), "'page_size' must be a power of two"),
    (dict(tokens=10, row_bucket=0), "'row_bucket' must be an int >= 1"),
    (dict(tokens=10, dtype="int8"), "'dtype' must be one of"),
    (dict(tokens=10, kv_format="fp4"), "'kv_format' must be one of"),
])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mem.plan_memory(_cfg(GLM5), **kw)


# ----------------------------------------------------------------------------- CLI


def test_cli_memory_json_and_text(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    argv = ["memory", "--model-config", str(tmp_path), "--cp", "8", "--ep", "8", "--tokens", "131072",
            "--dtype", "fp8", "--kv-format", "fp8"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = mem.plan_memory(_cfg(DEEPSEEK_V32), tokens=131072, cp=8, ep=8, dtype="fp8", kv_format="fp8")
    assert data["weights"] == plan.weights and data["total_bytes"] == plan.total_bytes
    assert data["kv_per_token"] == {"mla": 61 * 656, "index": 61 * 132}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "routed_experts" in text and "<- peak" in text and f"{plan.total_bytes:,} B" in text
    assert main(["memory", "--model-config", str(tmp_path / "config.json"), "--tokens", "4096"]) == 0  # the file too


def test_cli_memory_experts_provider(tmp_path, capsys):
    """``--experts-provider`` plans the named implementation: V3.2 FP8 at 32K, the Triton grouped GEMM (no
    DeepGEMM padding rows, no gathered copy) books a smaller MoE phase than the default DeepGEMM layout; a bad
    pairing is a one-line error."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    argv = ["memory", "--model-config", str(tmp_path), "--tokens", "32768", "--dtype", "fp8", "--json"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(argv + ["--experts-provider", "triton"]) == 0
    triton = json.loads(capsys.readouterr().out)
    assert (default["experts_provider"], triton["experts_provider"]) == ("deep_gemm", "triton")
    # The MoE phase shrinks (the total need not: at one device and 32K the attention phase is the peak).
    assert triton["activation_phases"]["moe"] < default["activation_phases"]["moe"]
    plan = mem.plan_memory(_cfg(DEEPSEEK_V32), tokens=32768, dtype="fp8", experts_provider="triton")
    assert triton["total_bytes"] == plan.total_bytes
    assert main(argv + ["--experts-provider", "deep_gemm", "--deterministic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpgraph memory: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,msg", [
    (["--cp", "8", "--ep", "4"], r"--ep must be 1 or equal to --cp \(8\)"),
    (["--tokens", "0"], "'tokens' must be an int >= 1"),
    (["--model-config", "nowhere"], "neither a local checkpoint directory nor a bundled model"),
    (["--page", "3"], "'page_size' must be a power of two"),
])
def test_cli_memory_errors_are_one_line(capsys, argv, msg):
    import re

    base = {"--model-config": "tiny-glm5", "--tokens": "4096"}
    flags = dict(zip(argv[::2], argv[1::2]))
    full = ["memory"] + [x for k, v in {**base, **flags}.items() for x in (k, v)]
    assert main(full) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpgraph memory: error: ") and err.count("\n") == 1 and re.search(msg, err), err


# ----------------------------------------------------------------------------- the fp32 products


_ALLOC = mem._Tape.alloc


def _bookings(monkeypatch, cfg, **kw) -> dict[str, int]:
    """Every buffer the activation replay books, by name (bytes summed over the replayed layers)."""
    booked: dict[str, int] = {}
    real = _ALLOC  # not the attribute: an earlier call of this test patched it

    def alloc(self, name, nbytes):
        booked[name] = booked.get(name, 0) + mem._block(int(nbytes))
        real(self, name, nbytes)

    monkeypatch.setattr(mem._Tape, "alloc", alloc)
    mem.activation_phases(cfg, 4096, 65536, **kw)
    return booked


def test_fp32_products_book_the_copy_of_x_only_where_it_exists(monkeypatch):
    """Router and ``weights_proj``: bf16 activations multiply as the bf16 split GEMM (no fp32 ``x``) unless in the
    deterministic mode, where ``x`` is upcast; the two replays differ by exactly that copy and the split's buffers."""
    cfg = _cfg(DEEPSEEK_V32)
    R, H, E, hi = 4096, 7168, 256, 64
    # the mode's routed experts are their own provider's (tests/plan/test_memory_experts.py): left out here
    fast, det = ({k: v for k, v in _bookings(monkeypatch, cfg, dtype="bf16", deterministic=d).items()
                  if not k.startswith("experts.")} for d in (False, True))
    # V3.2 replays two attention-layer kinds (the first layer, the later ones) and one MoE layer kind
    only_det = {k: v for k, v in det.items() if k not in fast}
    assert only_det == {"w.proj.x32": 2 * mem._block(4 * R * H), "router.logits.x32": mem._block(4 * R * H)}
    only_fast = {k: v for k, v in fast.items() if k not in det}
    assert only_fast["w.proj.y"] == 2 * mem._block(4 * R * 3 * hi)  # torch.mm(x, [hi; mid; lo].t()) in fp32
    assert only_fast["router.logits.y"] == mem._block(4 * R * 3 * E)
    assert only_fast["router.logits.parts"] == mem._block(2 * 3 * E * H)  # the weight's three bf16 parts
    assert not any(k.endswith(".x32") for k in fast)
    assert {k: v for k, v in fast.items() if k in det} == {k: v for k, v in det.items() if k in fast}
    # FP8 weights compute in bf16 (split); fp16 activations are upcast; fp32 ones are x itself (no copy)
    assert not any(k.endswith(".x32") for k in _bookings(monkeypatch, cfg, dtype="fp8"))
    assert _bookings(monkeypatch, cfg, dtype="fp16")["w.proj.x32"] == 2 * mem._block(4 * R * H)
    fp32 = _bookings(monkeypatch, cfg, dtype="fp32")
    assert not any(k.endswith((".x32", ".y")) for k in fp32 if not k.startswith("experts.")) and fp32["w.proj"] > 0


@pytest.mark.parametrize("dtype,act", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16), ("fp16", torch.float16),
                                       ("fp32", torch.float32)])
def test_the_plans_split_rule_is_the_models(dtype, act):
    """``_split_fp32_products`` follows ``models/fp32_linear.uses_split`` for a CUDA activation, in and out of the mode."""
    from types import SimpleNamespace

    from cpgraph.models.fp32_linear import uses_split
    from cpgraph.ops.invariant_mode import deterministic

    x = SimpleNamespace(is_cuda=True, dtype=act, dim=lambda: 2)  # the static facts uses_split reads
    assert mem._split_fp32_products(dtype, False) == uses_split(x)
    with deterministic():
        assert mem._split_fp32_products(dtype, True) == uses_split(x) is False


def test_plan_records_the_deterministic_mode(tmp_path, capsys):
    cfg = _cfg(DEEPSEEK_V32)
    plan = mem.plan_memory(cfg, tokens=131072, cp=8, row_bucket=4096, deterministic=True)
    assert plan.deterministic and plan.to_dict()["deterministic"] is True
    assert "(deterministic mode)" in mem.render_memory(plan)
    assert not mem.plan_memory(cfg, tokens=131072, cp=8, row_bucket=4096).deterministic
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    assert main(["memory", "--model-config", str(tmp_path), "--tokens", "4096", "--deterministic", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deterministic"] is True

"""FP8 block-quantized checkpoints: loading (dequantized and FP8), transformers as the oracle, malformed input.

The checkpoints are built here the way the released ones are: a seeded tiny
model's linear weights are quantised per 128 x 128 block (``scale_inv =
amax / 448``, e4m3 cast) and saved with safetensors next to a config.json
carrying ``quantization_config``.  The oracle is transformers 5.24 with the
same weights dequantised by this file's own code (``e4m3 * scale`` per
block, written independently of cpgraph's); where ``accelerate`` is
installed, transformers also loads the FP8 directory itself (its FP8 loader
requires that package, and on a machine without a GPU dequantises).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cpgraph.models import from_pretrained, prefill_logits
from cpgraph.models.config import DSAConfig, bundled_config_dict
from cpgraph.models.fp8 import FP8CheckpointError, FP8Linear
from cpgraph.models.moe import FP8Experts

from hf_oracle import make_pair, prompts

FP8 = torch.float8_e4m3fn
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": [128, 128]}


def blocky(model_type: str) -> dict:
    """A tiny config whose quantized dims are multiples of 128 or below it (transformers' dequantiser needs that)."""
    base = bundled_config_dict("tiny-deepseek-v32" if model_type == "deepseek_v32" else "tiny-glm5")
    return dict(base, hidden_size=256, q_lora_rank=128, kv_lora_rank=112, intermediate_size=256,
                moe_intermediate_size=128, initializer_range=0.05)


def ragged() -> dict:
    """Dims that leave partial blocks (200 = 128 + 72, ...): the ceil(out/128) x ceil(in/128) grid."""
    return dict(bundled_config_dict("tiny-deepseek-v32"), hidden_size=200, q_lora_rank=136, kv_lora_rank=120,
                intermediate_size=300, moe_intermediate_size=72, initializer_range=0.05)


def quantized(name: str, t: torch.Tensor) -> bool:
    """The weights the releases quantize: linear matrices, not embeddings / lm_head / norms / router / head weights."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj")
    return name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in skip)


def per_expert(state: dict) -> dict:
    """Stacked experts -> the on-disk per-expert names."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            gate, up = v.chunk(2, dim=1)
            for j in range(v.shape[0]):
                out[f"{base}{j}.gate_proj.weight"], out[f"{base}{j}.up_proj.weight"] = gate[j].clone(), up[j].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for j in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{j}.down_proj.weight"] = v[j].clone()
        else:
            out[k] = v.clone()
    return out


def stacked(state: dict) -> dict:
    """Per-expert names -> transformers' in-memory stacked layout."""
    out, experts = {}, {}
    for k, v in state.items():
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[: i + 1]), {})[(int(parts[i + 1]), parts[i + 2])] = v
        else:
            out[k] = v
    for prefix, d in experts.items():
        E = 1 + max(j for j, _ in d)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((d[(j, "gate_proj")], d[(j, "up_proj")])) for j in range(E)])
        out[f"{prefix}.down_proj"] = torch.stack([d[(j, "down_proj")] for j in range(E)])
    return out


def quantize(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The published recipe: per block, ``scale_inv = amax / 448``, ``e4m3(w / scale_inv)``."""
    bo, bi = block
    out, inn = w.shape
    grid = (-(-out // bo), -(-inn // bi))
    scale = torch.empty(grid, dtype=torch.float32)
    q = torch.empty(w.shape, dtype=FP8)
    for r in range(grid[0]):
        for c in range(grid[1]):
            blk = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi].float()
            s = blk.abs().max().clamp_min(1e-12) / 448
            scale[r, c] = s
            q[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = (blk / s).clamp(-448, 448).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """``e4m3 * scale`` of each element's block, in float64 then rounded once to fp32."""
    bo, bi = block
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            sl = (slice(r * bo, (r + 1) * bo), slice(c * bi, (c + 1) * bi))
            out[sl] = q[sl].double() * scale[r, c].double()
    return out.float()


def write_fp8_checkpoint(root, d: dict, state: dict, block=(128, 128), quant=None, shards=1) -> dict:
    """Quantize ``state`` (per-expert layout) into ``root``; returns the dequantized per-expert state."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(dict(d, quantization_config=quant or QUANT)))
    tensors, deq = {}, {}
    for k, v in state.items():
        if quantized(k, v):
            q, s = quantize(v, block)
            tensors[k], tensors[k + "_scale_inv"] = q, s
            deq[k] = dequantize(q, s, block)
        else:
            tensors[k] = v.contiguous()
            deq[k] = v
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
    else:  # weights and their scales in different files, scales first
        names = sorted(tensors, key=lambda n: (not n.endswith("_scale_inv"), n))
        files = {n: f"model-{i % shards:05d}.safetensors" for i, n in enumerate(names)}
        for f in set(files.values()):
            save_file({n: tensors[n] for n in names if files[n] == f}, str(root / f))
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    return deq


@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory):
    """(directory, transformers model with the dequantized weights, config dict)."""
    d = blocky("deepseek_v32")
    hf, _ = make_pair(d, seed=3)
    root = tmp_path_factory.mktemp("ds-fp8")
    deq = write_fp8_checkpoint(root, d, per_expert(hf.state_dict()))
    hf.load_state_dict(stacked(deq), strict=True)
    return root, hf, d


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def hf_logits(hf, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


# ----------------------------------------------------------------- oracle
@pytest.mark.parametrize("variant", ["ds-blocky", "glm-blocky", "ds-ragged"])
def test_dequantized_load_matches_transformers(tmp_path, variant):
    d = {"ds-blocky": lambda: blocky("deepseek_v32"), "glm-blocky": lambda: blocky("glm_moe_dsa"), "ds-ragged": ragged}[variant]()
    hf, _ = make_pair(d, seed=1)
    deq = write_fp8_checkpoint(tmp_path, d, per_expert(hf.state_dict()), shards=3)
    hf.load_state_dict(stacked(deq), strict=True)
    model = from_pretrained(tmp_path, dtype=torch.float32, weights="dequantize")
    loaded = dict(model.named_parameters())
    for name, t in stacked(deq).items():
        if name in loaded:
            assert torch.equal(loaded[name], t), name  # e4m3 * scale rounded once: bit-identical
    ps = prompts(d["vocab_size"], [12, 37], seed=5)
    got = prefill_logits(model, ps)
    for i, p in enumerate(ps):
        assert rel_err(got[i], hf_logits(hf, p)) <= 1e-5


def test_transformers_loads_the_fp8_directory_itself(ds_checkpoint):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    import transformers

    root, hf, d = ds_checkpoint
    theirs = transformers.DeepseekV32ForCausalLM.from_pretrained(root, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    ours = from_pretrained(root, dtype=torch.float32)
    for p in prompts(d["vocab_size"], [12, 37], seed=7):
        assert rel_err(prefill_logits(ours, [p])[0], hf_logits(theirs, p)) <= 1e-5


def test_fp8_weights_stay_e4m3_and_track_the_dequantized_model(ds_checkpoint):
    root, _, d = ds_checkpoint
    dense = from_pretrained(root, dtype=torch.float32)
    fp8 = from_pretrained(root, dtype=torch.float32, weights="fp8")
    layer = fp8.model.layers[1]
    attn = layer.self_attn
    for module in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj, attn.indexer.wq_b,
                   attn.indexer.wk, layer.mlp.shared_experts.gate_proj, fp8.model.layers[0].mlp.down_proj):
        assert isinstance(module, FP8Linear) and module.weight.dtype == FP8 and module.act_scale_pow2
    # Read as matrices, so dequantized: kv_b_proj (absorbed W_UK / W_UV), router, head weights.
    assert type(attn.kv_b_proj) is torch.nn.Linear and attn.kv_b_proj.weight.dtype == torch.float32
    assert isinstance(layer.mlp.experts, FP8Experts) and layer.mlp.experts.down_proj.dtype == FP8
    assert type(attn.indexer.weights_proj) is torch.nn.Linear and type(fp8.lm_head) is torch.nn.Linear
    # The e4m3 bytes and scales are the checkpoint's, bit for bit.
    from safetensors.torch import load_file

    raw = load_file(str(root / "model.safetensors"))
    name = "model.layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(attn.q_a_proj.weight.view(torch.uint8), raw[name].view(torch.uint8))
    assert torch.equal(attn.q_a_proj.weight_scale_inv, raw[name + "_scale_inv"])
    ps = prompts(d["vocab_size"], [12, 37], seed=9)
    assert torch.isfinite(prefill_logits(fp8, ps)).all()
    # One projection: the only difference from the dequantized model is the activation quantisation.
    x = torch.randn(10, d["hidden_size"], generator=torch.Generator().manual_seed(0))
    ref = dense.model.layers[1].self_attn.q_a_proj(x)
    err = float((attn.q_a_proj(x) - ref).norm() / ref.norm())
    assert 0 < err <= 0.04  # e4m3 with power-of-two scales: measured 0.026


def test_fp8_model_logits_bound(tmp_path):
    """End to end on an all-dense tiny model with prompts <= top-k (no routing or key selection to flip).

    Measured relative L2 error of the last-token logits, FP8 vs dequantized weights, 3 seeds x 4 prompts:
    0.08-0.12 (docs/models.md#fp8-checkpoints explains the regimes).  The bound is 0.2.
    """
    d = dict(blocky("deepseek_v32"), first_k_dense_replace=3)
    hf, _ = make_pair(d, seed=1)
    write_fp8_checkpoint(tmp_path, d, per_expert(hf.state_dict()))
    dense = from_pretrained(tmp_path, dtype=torch.float32)
    fp8 = from_pretrained(tmp_path, dtype=torch.float32, weights="fp8")
    ps = prompts(d["vocab_size"], [5, 9, 12, 16], seed=9)
    for a, b in zip(prefill_logits(fp8, ps), prefill_logits(dense, ps)):
        assert 0 < float((a - b).norm() / b.norm()) <= 0.2


def test_fp8_experts_keep_the_checkpoint_bytes_and_track_the_dequantized_experts(ds_checkpoint):
    """Routed experts stay e4m3: the stacks hold the per-expert bytes and scales, bit for bit."""
    from safetensors.torch import load_file

    root, _, d = ds_checkpoint
    dense = from_pretrained(root, dtype=torch.float32)
    fp8 = from_pretrained(root, dtype=torch.float32, weights="fp8")
    raw = load_file(str(root / "model.safetensors"))
    E, I = d["n_routed_experts"], d["moe_intermediate_size"]
    for i in range(d["first_k_dense_replace"], d["num_hidden_layers"]):
        ex = fp8.model.layers[i].mlp.experts
        assert isinstance(ex, FP8Experts) and ex.block == (128, 128) and ex.act_scale_pow2
        base = f"model.layers.{i}.mlp.experts"
        for j in (0, E - 1):
            for proj, stack, rows in (("gate_proj", "gate_up_proj", slice(0, I)), ("up_proj", "gate_up_proj", slice(I, 2 * I)),
                                      ("down_proj", "down_proj", slice(None))):
                w = raw[f"{base}.{j}.{proj}.weight"]
                assert torch.equal(getattr(ex, stack)[j, rows].view(torch.uint8), w.view(torch.uint8))
                s_rows = slice(rows.start // 128, rows.stop // 128) if rows.start is not None else slice(None)
                assert torch.equal(getattr(ex, stack + "_scale_inv")[j, s_rows], raw[f"{base}.{j}.{proj}.weight_scale_inv"])
    # The experts alone: the only difference from the dequantized ones is the activation quantisation.
    layer = d["first_k_dense_replace"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, d["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[: d["num_experts_per_tok"]] for _ in range(40)])
    w = torch.rand(ids.shape, generator=g)
    got = fp8.model.layers[layer].mlp.experts(x, ids, w)
    ref = dense.model.layers[layer].mlp.experts(x, ids, w)
    assert 0 < float((got - ref).norm() / ref.norm()) <= 0.08  # e4m3 input + SwiGLU output, ue8m0: measured 0.047
    ps = prompts(d["vocab_size"], [12, 37], seed=9)
    assert torch.isfinite(prefill_logits(fp8, ps)).all()


def test_fp8_experts_stay_dequantized_when_blocks_straddle_gate_and_up(tmp_path, caplog):
    """moe_intermediate_size 72 (not a multiple of 128): one scale row would cover gate and up rows."""
    d = ragged()
    hf, _ = make_pair(d, seed=1)
    write_fp8_checkpoint(tmp_path, d, per_expert(hf.state_dict()))
    with caplog.at_level("WARNING", logger="cpgraph.models"):
        model = from_pretrained(tmp_path, dtype=torch.float32, weights="fp8")
    ex = model.model.layers[d["first_k_dense_replace"]].mlp.experts
    assert not isinstance(ex, FP8Experts) and ex.gate_up_proj.dtype == torch.float32
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, FP8Linear)


def test_expert_parallel_shard_keeps_fp8_experts(ds_checkpoint):
    """An EP rank of an FP8 model holds its own experts' e4m3 stacks and scales (only those are read)."""
    root, _, d = ds_checkpoint
    whole = from_pretrained(root, dtype=torch.float32, weights="fp8")
    shard = from_pretrained(root, dtype=torch.float32, weights="fp8", ep_rank=1, ep_size=2)
    E = d["n_routed_experts"]
    for i in range(d["first_k_dense_replace"], d["num_hidden_layers"]):
        full, part = whole.model.layers[i].mlp.experts, shard.model.layers[i].mlp.experts
        assert isinstance(part, FP8Experts) and part.expert_range == (E // 2, E)
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(part, name).view(torch.uint8), getattr(full, name)[E // 2 :].view(torch.uint8))
            assert torch.equal(getattr(part, name + "_scale_inv"), getattr(full, name + "_scale_inv")[E // 2 :])


def test_expert_parallel_shard_of_an_fp8_checkpoint(ds_checkpoint):
    root, _, d = ds_checkpoint
    whole = from_pretrained(root, dtype=torch.float32)
    shard = from_pretrained(root, dtype=torch.float32, ep_rank=1, ep_size=2)
    E = d["n_routed_experts"]
    for i in (1, 2):
        full, part = whole.model.layers[i].mlp.experts, shard.model.layers[i].mlp.experts
        assert torch.equal(part.gate_up_proj, full.gate_up_proj[E // 2 :])
        assert torch.equal(part.down_proj, full.down_proj[E // 2 :])


def test_fp8_weights_need_less_memory(ds_checkpoint):
    """The memory check counts e4m3 weights at one byte: a limit the FP8 model fits refuses the dequantized one."""
    import re

    root, _, _ = ds_checkpoint

    def needed(**kw) -> int:
        with pytest.raises(ValueError, match="needs about") as err:
            from_pretrained(root, dtype=torch.bfloat16, memory_limit=1, **kw)
        return int(re.search(r"\((\d+) bytes\) of host RAM", str(err.value)).group(1))

    dense, fp8 = needed(), needed(weights="fp8")
    assert fp8 < dense
    with pytest.raises(ValueError, match="needs about"):
        from_pretrained(root, dtype=torch.bfloat16, memory_limit=fp8)
    model = from_pretrained(root, dtype=torch.bfloat16, memory_limit=fp8, weights="fp8")
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, FP8Linear)


# ------------------------------------------------------------ bad input
def _small_checkpoint(root, mutate=None, quant=None, block=(128, 128)):
    d = blocky("deepseek_v32")
    hf, _ = make_pair(dict(d, num_hidden_layers=1, first_k_dense_replace=1), seed=0)
    d = dict(d, num_hidden_layers=1, first_k_dense_replace=1)
    write_fp8_checkpoint(root, d, per_expert(hf.state_dict()), block=block, quant=quant)
    if mutate is not None:
        from safetensors.torch import load_file

        tensors = load_file(str(root / "model.safetensors"))
        mutate(tensors)
        save_file(tensors, str(root / "model.safetensors"))
    return root


Q = "model.layers.0.self_attn.q_a_proj.weight"


@pytest.mark.parametrize(
    "mutate,quant,block,needle",
    [
        (lambda t: t.pop(Q + "_scale_inv"), None, (128, 128),
         f"{Q}: quantized weight has no block scale {Q}_scale_inv"),
        (lambda t: t.__setitem__(Q + "_scale_inv", torch.ones(2, 2)), None, (128, 128),
         f"{Q}_scale_inv: shape (2, 2) does not match weight (128, 256) in blocks of 128x128"),
        (None, None, (64, 64), "(it fits blocks of 64x64: the checkpoint was quantized with another block size"),
        (lambda t: t.__setitem__(Q + "_scale_inv", t[Q + "_scale_inv"].double()), None, (128, 128),
         f"{Q}_scale_inv: block scales must be float32 (F32), got F64"),
        (lambda t: t.__setitem__("lm_head.weight_scale_inv", torch.ones(4, 2)), None, (128, 128),
         "lm_head.weight_scale_inv: block scale without a float8_e4m3fn weight lm_head.weight"),
        (None, dict(QUANT, modules_to_not_convert=["model.layers.0.self_attn.q_a_proj"]), (128, 128),
         "module model.layers.0.self_attn.q_a_proj is listed in quantization_config.modules_to_not_convert"),
        (lambda t: t.__setitem__(Q, t[Q].to(torch.float8_e5m2)), None, (128, 128),
         f"{Q}: F8_E5M2 weights are not supported"),
    ],
)
def test_malformed_checkpoints_fail_with_one_line_naming_the_tensor(tmp_path, mutate, quant, block, needle):
    root = _small_checkpoint(tmp_path, mutate, quant, block)
    with pytest.raises(FP8CheckpointError) as err:
        from_pretrained(root)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_fp8_weights_without_quantization_config(tmp_path):
    root = _small_checkpoint(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    del cfg["quantization_config"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FP8CheckpointError, match="float8_e4m3fn weight but config.json has no quantization_config"):
        from_pretrained(root)


@pytest.mark.parametrize(
    "quant,needle",
    [
        (dict(QUANT, quant_method="gptq"), "quant_method 'gptq' is not supported"),
        (dict(QUANT, fmt="e5m2"), "quantization_config.fmt must be 'e4m3'"),
        (dict(QUANT, weight_block_size=[128]), "weight_block_size must be two integers"),
        (dict(QUANT, weight_block_size=None), "weight_block_size must be two integers"),
        (dict(QUANT, scale_fmt="e4m3"), "scale_fmt must be 'ue8m0' or 'float'"),
        (dict(QUANT, activation_scheme="static"), "activation_scheme must be 'dynamic'"),
        (dict(QUANT, modules_to_not_convert="lm_head"), "modules_to_not_convert must be a list"),
        ("fp8", "quantization_config must be an object"),
    ],
)
def test_bad_quantization_config(quant, needle):
    d = dict(blocky("deepseek_v32"), quantization_config=quant)
    with pytest.raises(ValueError) as err:
        DSAConfig.from_hf_dict(d)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_modules_to_not_convert_match_like_transformers():
    q = DSAConfig.from_hf_dict(dict(blocky("deepseek_v32"), quantization_config=dict(
        QUANT, modules_to_not_convert=["lm_head", "self_attn.kv_b_proj", "model.layers.1", r"model\.layers\.\d+\.mlp\.gate"]))).quantization
    assert q.skips("lm_head") and q.skips("model.layers.7.self_attn.kv_b_proj")
    assert q.skips("model.layers.1.mlp.down_proj") and not q.skips("model.layers.11.mlp.down_proj")
    assert q.skips("model.layers.4.mlp.gate") and not q.skips("model.layers.4.mlp.gate_proj")
    assert q.block == (128, 128) and q.act_scale_pow2


def test_weights_argument_errors(tmp_path, ds_checkpoint):
    with pytest.raises(ValueError, match="weights must be one of dequantize, fp8"):
        from_pretrained("tiny-glm5", weights="int4")
    with pytest.raises(ValueError, match="weights='fp8' needs an FP8 checkpoint"):
        from_pretrained("tiny-glm5", weights="fp8")
    _, hf, d = ds_checkpoint
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="weights='fp8' needs an FP8 checkpoint"):
        from_pretrained(tmp_path, weights="fp8")


@pytest.mark.slow
def test_fp8_model_compiles_as_one_graph(ds_checkpoint):
    """FP8Linear is one custom-op node: the whole forward still traces with fullgraph=True and matches eager."""
    from test_compile import _inputs

    from cpgraph.models.prefill import make_layout

    root, _, _ = ds_checkpoint
    torch._dynamo.reset()
    model = from_pretrained(root, dtype=torch.float32, weights="fp8")
    model.kv_layout = make_layout(model, "bf16", 16)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(*_inputs(model, model.kv_layout, [21, 6]))
        ref = model(*_inputs(model, model.kv_layout, [21, 6]))
    assert torch.equal(got.logits, ref.logits)


@pytest.mark.slow
def test_expert_parallel_pass_keeps_the_fp8_experts_scales(ds_checkpoint):
    """The EP pass re-inserts ``moe_experts`` behind the dispatch with the FP8 stacks' block scales and recipe."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dist_utils import fake_group

    from cpgraph.models.prefill import make_layout
    from cpgraph.passes import CPConfig, compile
    from cpgraph.passes.fx_utils import find_nodes
    from cpgraph.passes.pipeline import default_passes
    from cpgraph.runtime.engine import run_prefill

    root, _, d = ds_checkpoint
    torch._dynamo.reset()
    shard = from_pretrained(root, dtype=torch.float32, weights="fp8", ep_rank=0, ep_size=2)
    shard.kv_layout = make_layout(shard, "bf16", 16)
    calls = []

    def capture(gm, cfg):
        calls.extend(dict(n.kwargs) for n in find_nodes(gm.graph, "cpgraph.moe_experts"))
        return gm

    with fake_group(world_size=2, rank=0) as gn:
        fn = compile(shard, CPConfig(group=gn, cp_size=2, ep=2), backend="aot_eager",
                     passes=default_passes() + [("capture", capture)])
        run_prefill(lambda *a, **k: fn(*a, **k), shard, [list(range(3, 30))], page_size=16, rank=0, cp_size=2)
    moe_layers = d["num_hidden_layers"] - d["first_k_dense_replace"]
    assert len(calls) == moe_layers
    for kw in calls:
        assert {"gate_up_scale", "down_scale", "block_n", "block_k"} <= set(kw), kw


def with_and_without(ds_checkpoint, pass_name: str):
    """Logits of the FP8 model compiled with and without ``pass_name`` (aot_eager), and the pass's change to the
    ``cpgraph.*`` op counts (once: the compile without it has no entry)."""
    from test_compile import _inputs

    from cpgraph.models.prefill import make_layout
    from cpgraph.passes import CPConfig, compile

    root, _, _ = ds_checkpoint
    model = from_pretrained(root, dtype=torch.float32, weights="fp8")
    model.kv_layout = make_layout(model, "bf16", 16)
    logits, deltas = [], []
    for disabled in ((), (pass_name,)):
        torch._dynamo.reset()
        fn = compile(model, CPConfig(disabled_passes=disabled), backend="aot_eager")
        logits.append(fn(*_inputs(model, model.kv_layout, [21, 6])).logits)
        deltas += [{k: a[k] - b[k] for k in set(a) | set(b) if a[k] != b[k] and k.startswith("cpgraph.")}
                   for name, b, a in fn.cpgraph_passes.history if name == pass_name]
    torch._dynamo.reset()
    return logits, deltas


@pytest.mark.slow
def test_projections_reading_one_input_share_its_quantisation(ds_checkpoint):
    """``share_activation_quantization`` on the whole FP8 model: q_a, kv_a and the indexer's wk share the normed
    hidden state's codes, q_b and the indexer's wq_b the query latent's, an MLP's gate and up theirs; o_proj and
    down keep their own.  The logits are bit-equal to the same compile without the pass (the codes are a function
    of the input alone and the GEMM half is the same function: equal by construction)."""
    logits, deltas = with_and_without(ds_checkpoint, "share_activation_quantization")
    assert torch.equal(logits[0], logits[1])
    layers = ds_checkpoint[2]["num_hidden_layers"]
    assert deltas == [{"cpgraph.fp8_block_linear": -7 * layers, "cpgraph.fp8_quantize_activations": 3 * layers,
                       "cpgraph.fp8_linear_quantized": 7 * layers}]


@pytest.mark.slow
def test_norms_quantise_for_the_projections_they_feed(ds_checkpoint):
    """``fuse_norm_into_quantization`` on the whole FP8 model: the input norm (with the residual add of every layer
    but the first) and the query latent's norm of each layer quantise for their projections, and a dense layer's
    post-attention norm for gate / up; a MoE layer's experts read compacted rows, so their quantisation stays.  The
    logits stay within an FP8 step of the same compile without the pass (tests/passes/test_fuse_norm_quant.py)."""
    logits, deltas = with_and_without(ds_checkpoint, "fuse_norm_into_quantization")
    assert rel_err(logits[0], logits[1]) <= 2**-6
    d = ds_checkpoint[2]
    fused = 2 * d["num_hidden_layers"] + d["first_k_dense_replace"]
    assert deltas == [{"cpgraph.fp8_quantize_activations": -fused, "cpgraph.fp8_rms_norm_quantize": fused}]

"""The FP8 forward (``weights="fp8"``: FP8 projections and FP8 routed experts) compiled and CUDA-graphed.

The checkpoint is written here without transformers (the GPU machine may
lack it): a seeded cpgraph model of the kernel-shaped tiny config (kv_lora
512, rope 64, index dim 128) with its linear weights quantised per 128 x 128
block by the published recipe, routed experts stored per expert.  On CPU the
same forward is traced with ``aot_eager`` (so the test's plumbing runs
everywhere); on a GPU it is compiled by ``cpgraph.compile`` with
``mode="reduce-overhead"`` and replayed from CUDA graphs.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cpgraph.models import build_batch, build_model, from_pretrained, init_random
from cpgraph.models.config import DSAConfig, bundled_config_dict
from cpgraph.models.fp8 import FP8Linear
from cpgraph.models.moe import FP8Experts
from cpgraph.models.prefill import make_layout
from cpgraph.plan import plan_prefill
from cpgraph.runtime.engine import pool_config
from cpgraph.runtime.kv_pool import KVPool

FP8 = torch.float8_e4m3fn
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": [128, 128]}
_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj")


def config() -> dict:
    """The kernel-shaped tiny DSA with dims the FP8 experts take (moe_intermediate a multiple of 128)."""
    return dict(bundled_config_dict("tiny-deepseek-v32-fp8"), hidden_size=256, q_lora_rank=128,
                intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128 x 128 block: ``scale_inv = amax / 448``, ``e4m3(w / scale_inv)``."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    blocks = torch.nn.functional.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view(nb * 128, kb * 128)[:n, :k].to(FP8)
    return q.contiguous(), scale.contiguous()


def write_checkpoint(root, d: dict, seed: int = 0) -> None:
    model = init_random(build_model(DSAConfig.from_hf_dict(d)), seed=seed, std=0.05)
    tensors = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            base, kind = k.rsplit(".", 1)
            for j in range(v.shape[0]):
                parts = v[j].chunk(2) if kind == "gate_up_proj" else (v[j],)
                names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for name, part in zip(names, parts):
                    tensors[f"{base}.{j}.{name}.weight"] = part
        else:
            tensors[k] = v
    out = {}
    for k, v in tensors.items():
        if k.endswith(".weight") and v.dim() == 2 and not any(s in k for s in _SKIP):
            out[k], out[k + "_scale_inv"] = quantize(v)
        else:
            out[k] = v.contiguous()
    save_file(out, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(dict(d, quantization_config=QUANT)))


def inputs(model, lens, device):
    layout = model.kv_layout
    pages = [-(-n // layout.page_size) for n in lens]
    pool = KVPool(pool_config(model, "bf16", layout.page_size, sum(pages) + 1))
    tables = [pool.alloc_pages_with_owners([0] * n) for n in pages]
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    plan = plan_prefill([0] * len(lens), lens, cp_size=1, page_size=layout.page_size, row_align=8)
    ids, meta = build_batch(plan, toks, tables, device)
    mla = [pool.mla_pool(i) for i in range(model.config.num_hidden_layers)]
    idx = [pool.index_pool(i) for i in model.config.indexer_layers]
    for t in mla + idx:
        torch._dynamo.mark_static_address(t)  # mutated in place: static addresses keep the CUDA graphs
    return ids, meta, mla, idx


def load(root, dtype, device):
    model = from_pretrained(root, dtype=dtype, device=device, weights="fp8").eval()
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts, FP8Experts) and isinstance(layer.self_attn.q_a_proj, FP8Linear)
    model.kv_layout = make_layout(model, "bf16", 16)
    return model


# Prompts no longer than the indexer's top-k (16): every key is selected, so no near-tie in the
# selection can flip between two compilations and amplify a rounding difference (with longer
# prompts and random weights, bf16 compiled vs eager logits differ by up to 40 %:
# docs/performance.md, CUDA graphs).
LENS = [16, 9, 5]


@pytest.mark.slow
def test_fp8_forward_traces_as_one_graph_on_cpu(tmp_path):
    """The plumbing of the GPU test below, everywhere: FP8 projections and experts trace fullgraph."""
    torch._dynamo.reset()
    write_checkpoint(tmp_path, config())
    model = load(tmp_path, torch.float32, "cpu")
    args = inputs(model, LENS, "cpu")
    with torch.no_grad():
        eager = model(*args).logits
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(*args).logits
    assert torch.isfinite(eager).all() and torch.equal(got, eager)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp8_forward_replays_from_cuda_graphs(tmp_path, dtype):
    """``cpgraph.compile(mode="reduce-overhead")`` of the FP8 model: captured (no CUDA-graph skips), replays
    deterministic, and equal to the un-graphed forward within the bound below.

    fp32 activations: replays against eager.  The FP8 kernels are the same in both; Inductor computes the
    fp32 elementwise work in another order, which now and then moves an activation across an e4m3
    rounding boundary: bound 2**-5 of the largest logit, 2**-7 relative L2.  bf16: replays against the
    same compilation without graphs (eager bf16 differs by Inductor's other bf16 roundings, not by the
    graphs): bound 2**-7 relative L2.
    """
    from torch._dynamo.utils import counters

    from cpgraph.ops import bind_providers
    from cpgraph.passes import CPConfig, compile

    bind_providers("cuda")

    write_checkpoint(tmp_path, config())
    model = load(tmp_path, dtype, "cuda")
    args = inputs(model, LENS, "cuda")
    with torch.no_grad():
        if dtype == torch.float32:
            ref = model(*args).logits.float()
        else:
            torch._dynamo.reset()
            ref = compile(model, CPConfig())(*args).logits.float().clone()
        torch._dynamo.reset()
        counters.clear()
        graphed = compile(model, CPConfig(), mode="reduce-overhead")
        got = [graphed(*args).logits.float().clone() for _ in range(3)]  # record, then two replays
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph_skip" in k}
    assert not skips, f"CUDA graphs were skipped: {skips}"
    assert torch.isfinite(ref).all()
    assert torch.equal(got[1], got[2])  # replays are deterministic
    scale = ref.abs().max()
    for out in got:
        err_max, err_l2 = float((out - ref).abs().max() / scale), float((out - ref).norm() / ref.norm())
        print(f"{dtype}: graphed vs reference: max {err_max:.3g} of the largest logit, relative L2 {err_l2:.3g}")
        assert err_l2 <= 2**-7
        if dtype == torch.float32:
            assert err_max <= 2**-5

"""The MTP draft layer on one device: an independent plain-torch reference, loading, draft inputs.

The reference (``mtp_reference.py``) is written from the definition and
reads only weights; transformers cannot serve as oracle (it drops the MTP
layer).  Eager runs only: the compiled and CP draft is in
``tests/runtime/test_mtp_cp.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtp_reference as ref  # noqa: E402

from cpgraph.models.batch import build_batch, build_draft_inputs  # noqa: E402
from cpgraph.plan import plan_prefill  # noqa: E402
from cpgraph.runtime.engine import pool_config, pool_tensors, run_prefill  # noqa: E402
from cpgraph.runtime.kv_pool import KVPool  # noqa: E402

PROMPTS_LENS = [30, 7, 20]
PREFIX = [16, 0, 0]
SAMPLED = [5, 6, 7]


def _prompts(lens=PROMPTS_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ref.CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def model():
    return ref.build()


def _target_hidden(model, prompts):
    """Final-normed target hidden states of every prompt token (one pass, no prefix), per request."""
    plan = plan_prefill([0] * len(prompts), [len(p) for p in prompts], cp_size=1, page_size=ref.PAGE)
    owners = [plan.page_owners(i) for i in range(len(prompts))]
    pool = KVPool(pool_config(model, "bf16", ref.PAGE, sum(len(o) for o in owners)))
    tables = [pool.alloc_pages_with_owners(o) for o in owners]
    ids, meta = build_batch(plan, prompts, tables)
    with torch.no_grad():
        out = model(ids, meta, *pool_tensors(pool, model), return_hidden=True)
    return list(out.hidden.split([len(p) for p in prompts]))


def _eager(model):
    return lambda ids, meta, mla, index, **kw: model(ids, meta, mla, index, **kw)


def test_draft_matches_plain_torch_reference(model):
    """Draft logits and the draft layer's KV records equal the reference (bs 3, a prefix hit, given tokens)."""
    prompts = _prompts()
    res = run_prefill(_eager(model), model, prompts, prefix_lens=PREFIX, page_size=ref.PAGE,
                      draft=model.draft_module(), draft_tokens=SAMPLED)
    w = ref.checkpoint_state(model)
    hidden = _target_hidden(model, prompts)
    N, L = ref.CONFIG["num_hidden_layers"], ref.CONFIG["kv_lora_rank"]
    records = res.pool.mla_pool(N)
    for i, p in enumerate(prompts):
        logits, latent, k_pe = ref.draft_forward(w, hidden[i], p, SAMPLED[i])
        torch.testing.assert_close(res.draft_logits[i], logits, rtol=0, atol=2e-5)
        pos = np.arange(len(p))
        slots = np.asarray(res.tables[i])[pos // ref.PAGE] * ref.PAGE + pos % ref.PAGE
        got = records[torch.from_numpy(slots)]
        torch.testing.assert_close(got[:, :L], latent, rtol=0, atol=2e-5)
        torch.testing.assert_close(got[:, L:], k_pe, rtol=0, atol=2e-5)
    assert res.sampled.tolist() == SAMPLED


def test_draft_defaults_to_the_target_greedy_token_and_leaves_the_target_alone(model):
    prompts = _prompts([9, 21], seed=1)
    plain = ref.build(draft=False)
    base = run_prefill(_eager(plain), plain, prompts, page_size=ref.PAGE)
    res = run_prefill(_eager(model), model, prompts, page_size=ref.PAGE, draft=model.draft_module())
    assert torch.equal(res.logits, base.logits)  # the target's weights and outputs do not depend on the draft
    assert res.sampled.tolist() == base.logits.argmax(-1).tolist()
    given = run_prefill(_eager(model), model, prompts, page_size=ref.PAGE, draft=model.draft_module(),
                        draft_tokens=res.sampled.tolist())
    assert torch.equal(given.draft_logits, res.draft_logits)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_draft_inputs_shift_each_request_by_one_token(cp):
    """Every computed token's next id is the prompt's next token; each request's last token is marked, once."""
    prompts = _prompts([30, 7, 1, 20], seed=2)
    prefix = [16, 0, 0, 16]
    plan = plan_prefill(prefix, [len(p) - q for p, q in zip(prompts, prefix)], cp_size=cp, page_size=ref.PAGE)
    seen = {}
    for rank in range(cp):
        d = build_draft_inputs(plan, prompts, torch.tensor([11, 12, 13, 14]), rank=rank)
        rp = plan.rank(rank, rerange=True)
        for row in range(rp.positions.shape[0]):
            i, pos = int(rp.req_index[row]), int(rp.positions[row])
            if i < 0:
                assert d.next_ids[row] == 0 and d.last_of[row] == -1
                continue
            assert (i, pos) not in seen
            seen[(i, pos)] = True
            if pos + 1 < len(prompts[i]):
                assert d.next_ids[row] == prompts[i][pos + 1] and d.last_of[row] == -1
            else:
                assert d.last_of[row] == i
    assert sorted(seen) == [(i, p) for i, t in enumerate(prompts) for p in range(prefix[i], len(t))]
    with pytest.raises(ValueError, match="one token per request"):
        build_draft_inputs(plan, prompts, torch.tensor([1]))
    with pytest.raises(ValueError, match="plan computes up to"):
        build_draft_inputs(plan, [p[:-1] for p in prompts])


# ---------------------------------------------------------------- loading
def _write_checkpoint(path: Path, tensors: dict, config: dict) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def test_draft_loads_from_checkpoint_names(model, tmp_path):
    from cpgraph.models import from_pretrained

    state = ref.checkpoint_state(model)
    ckpt = _write_checkpoint(tmp_path / "ckpt", state, ref.CONFIG)
    loaded = from_pretrained(ckpt, draft=True)
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and any(k.startswith("mtp.") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    target_only = from_pretrained(ckpt)  # the MTP tensors are skipped, as before
    assert not target_only.has_draft and not any(k.startswith("mtp.") for k in target_only.state_dict())


def test_draft_missing_from_checkpoint_is_one_clear_error(model, tmp_path):
    from cpgraph.models import from_pretrained

    N = ref.CONFIG["num_hidden_layers"]
    state = {k: v for k, v in ref.checkpoint_state(model).items() if not k.startswith(f"model.layers.{N}.")}
    ckpt = _write_checkpoint(tmp_path / "no_mtp", state, ref.CONFIG)
    with pytest.raises(ValueError, match=rf"no MTP layer \(no model.layers.{N}.\* tensors\)") as info:
        from_pretrained(ckpt, draft=True)
    assert "\n" not in str(info.value)
    undeclared = _write_checkpoint(tmp_path / "undeclared", state, dict(ref.CONFIG, num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="declares no MTP layer"):
        from_pretrained(undeclared, draft=True)
    with pytest.raises(ValueError, match="no MTP draft layer"):
        ref.build(draft=False).draft_module()


def _quantize_e4m3(w: torch.Tensor, block: int):
    """Block-scaled e4m3 as the FP8 releases store it: ``scale_inv = amax / 448`` per block."""
    out, inn = w.shape
    grid = (-(-out // block), -(-inn // block))
    scale = torch.empty(grid)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    deq = torch.empty(w.shape)
    for r in range(grid[0]):
        for c in range(grid[1]):
            sl = (slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block))
            s = w[sl].abs().max().clamp_min(1e-12) / 448
            scale[r, c] = s
            q[sl] = (w[sl] / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            deq[sl] = (q[sl].double() * s.double()).float()
    return q, scale, deq


def test_draft_loads_dequantized_from_an_fp8_checkpoint(model, tmp_path):
    """The draft's block-quantized weights (``weight_scale_inv`` siblings) load dequantized, like the target's."""
    from cpgraph.models import from_pretrained

    N = ref.CONFIG["num_hidden_layers"]
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj", "shared_head.head")
    tensors, want = {}, {}
    for k, v in ref.checkpoint_state(model).items():
        if k.endswith(".weight") and v.dim() == 2 and not any(s in k for s in skip):
            q, s, deq = _quantize_e4m3(v, 16)
            tensors[k], tensors[k[: -len("weight")] + "weight_scale_inv"] = q, s
            want[k] = deq
        else:
            tensors[k] = v
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    ckpt = _write_checkpoint(tmp_path / "fp8", tensors, dict(ref.CONFIG, quantization_config=quant))
    loaded = from_pretrained(ckpt, draft=True)
    prefix = f"model.layers.{N}."
    checked = 0
    for k, deq in want.items():
        if k.startswith(prefix):
            rest = k[len(prefix):]
            top = rest.split(".", 1)[0] in ("enorm", "hnorm", "eh_proj", "shared_head")
            name = ("mtp." if top else "mtp.block.") + rest
            if ".experts." in name:
                continue  # stacked in the model; their dequantisation is the target's code path
            torch.testing.assert_close(loaded.state_dict()[name], deq, rtol=0, atol=0)
            checked += 1
    assert checked >= 5  # eh_proj and the attention projections at least

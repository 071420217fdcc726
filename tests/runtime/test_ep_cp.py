"""CP + EP prefill equals the single-device run; each rank loads and holds only its experts.

A two-layer GLM-5-style tiny model (layer 0 dense with an indexer, layer 1 a
MoE with 8 experts, top-2) is saved as a safetensors checkpoint in the
per-expert layout DeepSeek ships.  Each of 2 gloo ranks loads it with
``from_pretrained(..., ep_rank=rank, ep_size=2)`` (4 experts),
compiles it with ``CPConfig(cp_size=2, ep=2)`` (aot_eager) and prefills
batches with tiny extends, prefix-cache hits, page-tail slack, and one batch
whose every row routes to rank 0's experts (router correction bias).  The
reference is the whole checkpoint run eagerly on one device in this process.

Why 2 ranks and not also 4 (each rank compiles the model, so 4 ranks cost CI
about three times as much): what a fourth rank adds is checked where it is
cheap.  The EP rewrite's dispatch and combine over 4 gloo ranks, compiled,
with every row routed to one rank and a rank without real rows:
``tests/passes/test_expert_parallel_pass.py`` (``world=4``, the MoE module);
loading one rank's experts of 4: ``test_rank_reads_only_its_experts`` and
``test_from_hf_keeps_only_the_local_experts`` below; the CP passes on 4
ranks: ``tests/passes/test_cp_numerics.py``.  This test is where they meet in
one compiled model, and that meeting is the same code at 2 ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cpgraph.models import from_pretrained
from cpgraph.models.config import bundled_config_dict
from cpgraph.models.moe import Experts
from cpgraph.models.prefill import make_layout
from cpgraph.runtime.engine import run_prefill, weight_bytes_per_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import shared_pool  # noqa: E402

PAGE = 16
pytestmark = pytest.mark.slow

TIMEOUT_S = 900.0  # a peer may be compiling while this rank waits in a collective
E = 8
MOE_LAYER = 1

WORLD = 2
# (prompt lengths, cached prefix lengths, route every row to rank 0's experts); >= 2 requests in
# each pass (a batch dimension of 1 specializes: a graph of its own), so one compile serves every
# pass, with and without a cached prefix (build_batch never gives prefix_slots 0 or 1 rows).
BATCHES = [
    ([96, 40, 17, 130], [64, 0, 0, 16], False),  # mixed lengths, prefix hits, page-tail slack
    ([17, 1, 33, 2], [16, 0, 32, 0], False),  # tiny extends: ranks with no real row
    ([50, 23, 9], [32, 16, 0], True),  # every routed pair goes to rank 0
]


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def _config():
    return dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The model as a per-expert safetensors checkpoint (``mlp.experts.<j>.{gate,up,down}_proj.weight``)."""
    from safetensors.torch import save_file

    from cpgraph.models import DSAConfig, build_model, init_random

    model = init_random(build_model(DSAConfig.from_hf_dict(_config())), seed=0, std=0.1)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            stem, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for j in range(t.shape[0]):
                tensors[f"{stem}{j}.gate_proj.weight"] = t[j, :inter].clone()
                tensors[f"{stem}{j}.up_proj.weight"] = t[j, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for j in range(t.shape[0]):
                tensors[f"{name[: -len('down_proj')]}{j}.down_proj.weight"] = t[j].clone()
        else:
            tensors[name] = t.contiguous()
    root = tmp_path_factory.mktemp("ep_checkpoint")
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(_config()))
    return str(root)


def _load(path, ep_rank=0, ep_size=1):
    model = from_pretrained(path, ep_rank=ep_rank, ep_size=ep_size)
    model.kv_layout = make_layout(model, "bf16", PAGE)
    return model


def _router_bias(model):
    return model.model.layers[MOE_LAYER].mlp.gate.e_score_correction_bias


def _run_batches(forward, model, rank, cp_size, per_rank_experts):
    out = []
    for k, (lens, prefix, to_rank0) in enumerate(BATCHES):
        bias = _router_bias(model)
        saved = bias.clone()
        if to_rank0:
            with torch.no_grad():
                bias[:per_rank_experts] += 100.0
        res = run_prefill(forward, model, _prompts(lens, k), prefix_lens=prefix, page_size=PAGE, rank=rank,
                          cp_size=cp_size)
        with torch.no_grad():
            bias.copy_(saved)
        out.append(res.logits.numpy().copy())
    return out


def job_cp_ep(ctx, path):
    from cpgraph.passes import CPConfig, compile

    torch._inductor.config.fx_graph_cache = False
    W = ctx.world_size
    model = _load(path, ep_rank=ctx.rank, ep_size=W)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    fn = compile(model, CPConfig(group=ctx.group_name, cp_size=W, ep=W), backend="aot_eager", dynamic=True)
    logits = _run_batches(lambda *a, **kw: fn(*a, **kw), model, ctx.rank, W, E // W)
    return {
        "logits": logits,
        "expert_range": experts[0].expert_range,
        "local_experts": int(experts[0].gate_up_proj.shape[0]),
        "weight_bytes": weight_bytes_per_rank(model),
    }


def _reference(checkpoint, world):
    """The whole model, eager, one device; the skewed batch favours the experts rank 0 of ``world`` holds."""
    model = _load(checkpoint)
    logits = _run_batches(lambda *a, **kw: model(*a, **kw), model, 0, 1, E // world)
    return logits, weight_bytes_per_rank(model)


def test_cp_ep_equals_single_device(checkpoint):
    world = WORLD
    pending = shared_pool(world, TIMEOUT_S).submit(job_cp_ep, checkpoint)  # the reference computes meanwhile
    ref_logits, full_bytes = _reference(checkpoint, world)
    results = pending.result()
    per = E // world
    assert [r["expert_range"] for r in results] == [(r * per, (r + 1) * per) for r in range(world)]
    # Every rank holds the replicated part plus E / W experts: equal shares, less than the whole model.
    assert len({r["weight_bytes"] for r in results}) == 1 and results[0]["weight_bytes"] < full_bytes
    worst = []
    for k, ref in enumerate(ref_logits):
        for r in results[1:]:
            assert np.array_equal(r["logits"][k], results[0]["logits"][k]), f"batch {k}: ranks disagree"
        got = results[0]["logits"][k]
        rel = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        worst.append(f"{rel:.1e}")
        # fp32; the EP combine sums the top-k slots where the one-device experts sum E dense columns.
        assert rel <= 1e-5, f"batch {k}: CP+EP vs single device, relative {rel:.2e}"
    print(f"\nCP{world}+EP{world} vs single device: max relative logit difference per batch {worst}; "
          f"weights per rank {results[0]['weight_bytes']} B of {full_bytes} B")


def test_rank_reads_only_its_experts(checkpoint, monkeypatch):
    """Loading rank 1 of 4 never reads another rank's expert tensors (lazy safetensors slices)."""
    import safetensors

    read = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

        def get_slice(self, key):
            sl = self.f.get_slice(key)

            class Slice:
                def __getitem__(_, rows):
                    read.append(key)
                    return sl[rows]

                def __getattr__(_, name):
                    return getattr(sl, name)

            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    model = from_pretrained(checkpoint, ep_rank=1, ep_size=4)
    experts_read = sorted({int(k.split(".")[5]) for k in read if ".mlp.experts." in k})
    assert experts_read == [2, 3]
    assert [m.expert_range for m in model.modules() if isinstance(m, Experts)] == [(2, 4)]
    whole = from_pretrained(checkpoint)
    mine, ref = model.model.layers[MOE_LAYER].mlp.experts, whole.model.layers[MOE_LAYER].mlp.experts
    assert torch.equal(mine.gate_up_proj, ref.gate_up_proj[2:4]) and torch.equal(mine.down_proj, ref.down_proj[2:4])


def test_uneven_expert_split_is_one_line_error(checkpoint):
    with pytest.raises(ValueError, match=r"^expert parallel: 8 routed experts do not split evenly over ep=3 ranks$"):
        from_pretrained(checkpoint, ep_rank=0, ep_size=3)


def test_from_hf_keeps_only_the_local_experts():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from hf_oracle import config_variants, make_pair

    from cpgraph.models import from_hf

    hf, whole = make_pair(dict(config_variants()["glm-a"], num_hidden_layers=2))
    ref = whole.model.layers[MOE_LAYER].mlp.experts
    for rank in range(4):
        mine = from_hf(hf, ep_rank=rank, ep_size=4).model.layers[MOE_LAYER].mlp.experts
        lo, hi = 2 * rank, 2 * rank + 2
        assert mine.expert_range == (lo, hi)
        assert torch.equal(mine.gate_up_proj, ref.gate_up_proj[lo:hi]) and torch.equal(mine.down_proj, ref.down_proj[lo:hi])

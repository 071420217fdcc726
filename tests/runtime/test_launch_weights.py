"""``cpgraph launch`` weights: FP8 checkpoints kept in e4m3 (``LaunchSpec.weights``) and each rank's weight bytes.

Cheap checks run in this process (the refusals, a rank's model as the spec
asks, the gathered report); one slow test runs a CP group of 2 gloo ranks
(``aot_eager``) on a tiny FP8 checkpoint.  Its ranks get the environment
torchrun gives the ranks of a node and fork from the suite's fork server
(``test_launch.run_ranks``: torch and the compiler come imported); the
torchrun jobs themselves are ``test_launch.py``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from cpgraph.models import from_pretrained, prefill_logits
from cpgraph.models.config import DSAConfig
from cpgraph.plan.memory import weight_bytes
from cpgraph.runtime import launch
from cpgraph.runtime.engine import weight_bytes_per_rank
from cpgraph.runtime.inputs import InputError, builtin_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_fp8_checkpoint import blocky, per_expert, write_fp8_checkpoint  # noqa: E402

from hf_oracle import make_pair  # noqa: E402

ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A two-layer DeepSeek-V3.2-shaped FP8 checkpoint (one dense, one MoE layer; 128 x 128 block scales)."""
    d = dict(blocky("deepseek_v32"), num_hidden_layers=2, first_k_dense_replace=1)
    hf, _ = make_pair(d, seed=0)
    root = tmp_path_factory.mktemp("fp8ckpt")
    write_fp8_checkpoint(root, d, per_expert(hf.state_dict()))
    return root


@pytest.mark.parametrize("model,weights,msg", [
    ("tiny-glm5", "fp8", "--weights fp8 needs an FP8 checkpoint; bundled model 'tiny-glm5' has random dense weights"),
    ("tiny-glm5", "int4", "--weights must be 'dequantize' or 'fp8', got 'int4'"),
])
def test_bad_weights_are_refused_before_joining(model, weights, msg):
    """Every rank reads the same config: the refusal comes before any process group (no rendezvous is attempted)."""
    spec = launch.LaunchSpec(model=model, cp=2, device="cpu", weights=weights)
    with pytest.raises(InputError, match=msg):
        launch.run_launch(spec, environ=ENV)


def test_rank_model_keeps_fp8_and_loads_only_its_experts(fp8_checkpoint):
    cfg = DSAConfig.from_hf_dict(json.loads((fp8_checkpoint / "config.json").read_text()))
    layout = launch.RankLayout(world_size=2, cp=2, ep=2)
    dense = {j: launch.load_rank_model(launch.LaunchSpec(model=str(fp8_checkpoint), ep=2, dtype="float32"), layout, j)[0]
             for j in (0, 1)}
    for j, model in dense.items():
        # Dequantized to fp32: exactly the plan's per-rank bytes for EP 2 (the local half of the experts).
        assert weight_bytes_per_rank(model) == sum(weight_bytes(cfg, "fp32", ep=2).values())
        assert model.model.layers[1].mlp.experts.expert_range == (4 * j, 4 * j + 4)
    spec = launch.LaunchSpec(model=str(fp8_checkpoint), ep=2, dtype="bfloat16", weights="fp8")
    fp8, kv_layout = launch.load_rank_model(spec, layout, 1)
    assert kv_layout.kv_format == "dense"
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.parameters())
    bf16 = launch.load_rank_model(launch.LaunchSpec(model=str(fp8_checkpoint), ep=2, dtype="bfloat16"), layout, 1)[0]
    assert weight_bytes_per_rank(fp8) < weight_bytes_per_rank(bf16)


def test_group_report_carries_weight_bytes_in_group_rank_order():
    logits = torch.zeros(1, 4).numpy()
    items = [dict(rank=r, group=0, group_rank=r, indices=[0], tokens=[[1, 2]], prefix=[0],
                  logits=logits if r == 0 else None, digest="d", kv_bytes=10 + r, weight_bytes=100 + r, pages=1,
                  replicated=21, seconds=[0.1]) for r in (1, 0)]
    res = launch._assemble(items, launch.RankLayout(2, 2, 2), torch.device("cpu"), "aot_eager", "fp8")
    (group,) = res.groups
    assert group.weight_bytes_per_rank == [100, 101] and group.kv_bytes_per_rank == [10, 11]
    assert res.weights == "fp8"


def fp8_group(model: str) -> dict | None:
    """This rank's part of a --cp 2 launch that keeps the FP8 weights; global rank 0 returns the result."""
    spec = launch.LaunchSpec(model=model, cp=2, device="cpu", backend="aot_eager", weights="fp8", timeout=300)
    res = launch.run_launch(spec)  # the rank and rendezvous from the environment, as under torchrun
    if res is None:
        return None
    return dict(weights=res.weights, weight_bytes=res.groups[0].weight_bytes_per_rank,
                kv_bytes=res.groups[0].kv_bytes_per_rank, agree=res.groups[0].ranks_agree, tokens=res.tokens,
                logits=res.logits.tolist())


@pytest.mark.slow
def test_launch_cp_group_on_fp8_weights(fp8_checkpoint):
    """2 ranks (--cp 2) keep the FP8 projections; logits equal one device's FP8 model, weight bytes per rank reported."""
    from test_launch import run_ranks

    data, other = run_ranks(fp8_group, 2, str(fp8_checkpoint))
    assert other is None  # only global rank 0 returns the result
    model = from_pretrained(str(fp8_checkpoint), weights="fp8")
    assert data["weights"] == "fp8" and data["agree"]
    assert data["weight_bytes"] == [weight_bytes_per_rank(model)] * 2  # CP without EP: every rank holds it all
    assert data["tokens"] == builtin_prompts(model.config.vocab_size)
    ref = prefill_logits(model, data["tokens"])
    torch.testing.assert_close(torch.tensor(data["logits"]), ref.float(), rtol=1e-4, atol=1e-4)

"""``--deterministic`` on the command line: ``run`` computes in the mode, ``launch`` refuses what the mode cannot do.

``run --deterministic`` (one device, eager) writes the logits the library
gives inside ``deterministic()``, batched or one prompt at a time, bit for
bit, and its provider report names the invariant ops.  ``CPConfig`` refuses
``deterministic`` with expert parallelism, and ``launch`` says so before
any rank starts.
"""

from __future__ import annotations

import json

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import prefill_logits, tiny_model
from cpgraph.ops.invariant_mode import deterministic
from cpgraph.passes import CPConfig

PROMPTS = [[1, 2, 3, 4, 5] * 7, [9, 8, 7] * 6, list(range(40, 61))]


def test_run_deterministic_matches_the_library_in_any_batch(tmp_path):
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(PROMPTS))
    runs = {}
    for bs in ("3", "1"):
        out = tmp_path / f"out{bs}.json"
        assert main(["run", "--model", "tiny-glm5", "--prompts-file", str(pf), "--prefix-lens", "16,0,16",
                     "--batch-size", bs, "--deterministic", "--quiet", "--json", str(out)]) == 0
        runs[bs] = json.loads(out.read_text())
    with deterministic():
        ref = prefill_logits(tiny_model("tiny-glm5"), PROMPTS, prefix_lens=[16, 0, 16])
    for data in runs.values():
        assert torch.equal(torch.tensor(data["logits"]), ref.float())
        # The eager products (aten kernels replaced by the mode) are counted under invariant_mm.
        assert {"invariant_mm", "invariant_moe_experts", "invariant_mla_query"} <= set(data["providers"])
        assert "moe_experts" not in data["providers"]


def test_deterministic_refuses_expert_parallelism(capsys):
    with pytest.raises(ValueError, match="deterministic=True needs ep=1"):
        CPConfig(group="g", cp_size=2, ep=2, deterministic=True)
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        CPConfig(deterministic=1)
    assert main(["launch", "--model", "tiny-glm5", "--cp", "2", "--ep", "2", "--deterministic"]) == 2
    assert "--deterministic needs --ep 1" in capsys.readouterr().err

"""``cpgraph run --cp 2``: spawns gloo ranks, writes the same JSON as a single-device run."""

from __future__ import annotations

import json

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import prefill_logits, tiny_model

pytestmark = pytest.mark.slow


def test_run_cp2_json_matches_single_device(tmp_path, capsys):
    out = tmp_path / "cp.json"
    rc = main(["run", "--model", "tiny-glm5", "--prefix-lens", "64,0,0,16", "--cp", "2", "--backend", "aot_eager",
               "--quiet", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text and "every rank holds the same logits: True" in text
    assert "rank 1: KV" in text and "of a replicated cache" in text
    data = json.loads(out.read_text())
    assert {"logits", "tokens", "top_ids", "kv_format", "prefix_lens"} <= data.keys()  # same keys as one device
    ref = prefill_logits(tiny_model("tiny-glm5"), data["tokens"], prefix_lens=data["prefix_lens"])
    assert torch.equal(torch.tensor(data["logits"]), ref)
    assert sum(data["kv_bytes_per_rank"]) == data["replicated_kv_bytes"]


def test_run_cp_rejects_bad_flags(capsys):
    assert main(["run", "--model", "tiny-glm5", "--device", "cuda"]) == 2
    assert "apply to CP runs" in capsys.readouterr().err
    assert main(["run", "--model", "tiny-glm5", "--cp", "0"]) == 2

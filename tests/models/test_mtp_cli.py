"""``cpgraph run --draft``: the draft's top tokens beside the target's (one device, eager)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtp_reference as ref  # noqa: E402

from cpgraph.cli import main  # noqa: E402


def test_run_draft_prints_and_writes_the_draft_top_tokens(tmp_path, capsys):
    from cpgraph.models import from_pretrained
    from cpgraph.runtime.engine import run_prefill

    out = tmp_path / "out.json"
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    assert main(["run", "--model", "tiny-glm5", "--draft", "--quiet", "--top", "2", "--prompts-file",
                 str(tmp_path / "p.json"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    # The same computation through the API: the bundled model with its seeded random draft layer.
    model = from_pretrained("tiny-glm5", draft=True)
    res = run_prefill(lambda *a, **k: model(*a, **k), model, prompts, draft=model.draft_module())
    assert doc["draft_after"] == res.logits.argmax(-1).tolist() == res.sampled.tolist()
    assert doc["draft_top_ids"] == res.draft_logits.topk(2, dim=-1).indices.tolist()
    torch.testing.assert_close(torch.tensor(doc["draft_logits"]), res.draft_logits, rtol=0, atol=1e-6)
    for i, (after, top) in enumerate(zip(doc["draft_after"], doc["draft_top_ids"])):
        assert f"prompt {i}: draft (MTP) after target token {after}: top ids {top}" in text
    assert doc["top_ids"] == res.logits.topk(2, dim=-1).indices.tolist()


def test_run_draft_cache_warm_equals_cold(tmp_path, capsys):
    """``--draft --cache``: both passes run the draft; the warm pass (L1 hits, the draft's cached records) gives
    the cold pass's draft logits, and those are ``run_prefill``'s."""
    from cpgraph.models import from_pretrained
    from cpgraph.runtime.engine import run_prefill

    out = tmp_path / "out.json"
    prompts = [list(range(1, 40)), list(range(1, 33)) + [7, 9]]  # a shared prefix of two pages
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    assert main(["run", "--model", "tiny-glm5", "--draft", "--cache", "--quiet", "--prompts-file",
                 str(tmp_path / "p.json"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "draft (MTP) second pass vs first pass" in text and "MISMATCH" not in text
    doc = json.loads(out.read_text())
    assert doc["hits"][1]["device"] > 0  # the warm pass hit the cache
    model = from_pretrained("tiny-glm5", draft=True)
    res = run_prefill(lambda *a, **k: model(*a, **k), model, prompts, draft=model.draft_module())
    assert doc["draft_after"] == res.sampled.tolist()
    for key in ("draft_logits", "second_pass_draft_logits"):
        torch.testing.assert_close(torch.tensor(doc[key]), res.draft_logits, rtol=0, atol=1e-5)


def test_run_draft_refusals(tmp_path, capsys):
    assert main(["run", "--model", "tiny-glm5", "--draft", "--cache", "--cp", "2", "--quiet"]) == 2
    assert "--draft with --cache runs on one device" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(dict(ref.CONFIG, num_nextn_predict_layers=0)))
    assert main(["run", "--model", str(ckpt), "--draft", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "declares no MTP layer" in err and err.count("\n") == 1

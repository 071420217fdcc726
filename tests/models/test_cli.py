"""``cpgraph run``: report, JSON output, prompts file, prefix lengths, input errors."""

from __future__ import annotations

import json

import torch

from cpgraph.cli import main
from cpgraph.models import prefill_logits, tiny_model


def test_run_writes_json_matching_prefill_logits(tmp_path, capsys):
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7]]
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    rc = main(["run", "--model", "tiny-glm5", "--prompts-file", str(pf), "--prefix-lens", "32,0", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "prompt 0: 35 tokens (prefix 32): top ids" in captured.out
    assert "bytes used" in captured.out and "extend pass" in captured.err  # report + progress
    data = json.loads(out.read_text())
    assert data["tokens"] == prompts
    ref = prefill_logits(tiny_model("tiny-glm5"), prompts, prefix_lens=[32, 0])
    got = torch.tensor(data["logits"])
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=0, atol=1e-6)
    top = ref.topk(5, dim=-1).indices.tolist()
    assert f"top ids {top[1]}" in captured.out


def test_run_builtin_prompts_fp8_batches(capsys):
    rc = main(["run", "--model", "tiny-deepseek-v32-fp8", "--kv-format", "fp8", "--batch-size", "2", "--top", "3"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.count("top ids") == 4
    assert "batch 2/2" in captured.err


def test_run_input_errors_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        ["run", "--model", "no-such-model"],
        ["run", "--model", "tiny-glm5", "--prompts-file", str(bad)],
        ["run", "--model", "tiny-glm5", "--prompts-file", str(tmp_path / "missing.json")],
        ["run", "--model", "tiny-glm5", "--prefix-lens", "16"],  # 4 built-in prompts
        ["run", "--model", "tiny-glm5", "--prefix-lens", "5,0,0,0"],  # not a page multiple
        ["run", "--model", "tiny-glm5", "--kv-format", "fp8"],  # needs kv_lora 512 / rope 64
        ["run", "--model", "tiny-glm5", "--batch-size", "0"],  # was read as "all prompts"
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("cpgraph run: error:") and err.count("\n") == 1 and "Traceback" not in err, err

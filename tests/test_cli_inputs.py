"""Every user error of the ``cpgraph`` command is one line on stderr and exit status 2.

All of these fail while the input is read and checked: no rank is spawned
and no model compiled (``run_cp`` / ``run_pd`` are replaced by functions that
fail the test if they are reached).
"""

from __future__ import annotations

import json

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import tiny_model
from cpgraph.models.config import bundled_config_dict


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if the command gets as far as spawning ranks."""
    import cpgraph.runtime.cp_run as cp_run
    import cpgraph.transfer.pd as pd

    def spawned(*a, **k):
        raise AssertionError("ranks were spawned for an input error")

    monkeypatch.setattr(cp_run, "run_cp", spawned)
    monkeypatch.setattr(pd, "run_pd", spawned)


def user_error(capsys, argv) -> str:
    """Run ``cpgraph argv``; assert exit 2 and one stderr line without a traceback; return the line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, (argv, err)
    return lines[0]


@pytest.fixture
def prompts_file(tmp_path):
    def write(prompts) -> str:
        path = tmp_path / "prompts.json"
        path.write_text(json.dumps(prompts))
        return str(path)

    return write


RUN = ["run", "--model", "tiny-glm5"]


@pytest.mark.parametrize("argv, expected", [
    (RUN + ["--json", "/nonexistent-dir/out.json"], "directory '/nonexistent-dir' does not exist"),
    (RUN + ["--top", "-1"], "--top must be >= 1, got -1"),
    (RUN + ["--top", "0"], "--top must be >= 1, got 0"),
    (RUN + ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (RUN + ["--write-policy", "write_back"], "--write-policy applies to --cache --evict runs"),
    (RUN + ["--cache", "--cache-layout", "page_first"], "--cache-layout applies to --cache --evict runs"),
    (RUN + ["--evict"], "--evict applies to --cache runs"),
    (RUN + ["--cuda-graphs"], "--cuda-graphs applies to --cache runs with --device cuda"),
    (RUN + ["--cache", "--cuda-graphs"], "--cuda-graphs applies to --cache runs with --device cuda"),
    (RUN + ["--cache", "--evict", "--cuda-graphs", "--device", "cuda"], "--cuda-graphs does not take --evict"),
    (RUN + ["--prefix-lens", "-16,0"], "write --prefix-lens=-16,0"),
    (RUN + ["--prefix-lens=-16,0,0,0"], "prefix length 0 must be an int >= 0, got -16"),
    (RUN + ["--prefix-lens", "5,0,0,0"], "prefix length 0 = 5 is not a multiple of the page size 16"),
    (RUN + ["--prefix-lens", "96,0,0,0"], "prefix length 0 = 96 leaves no token to compute"),
    (RUN + ["--cp", "0"], "--cp must be >= 1, got 0"),
    (RUN + ["--cp", "2", "--prefix-lens", "0,0,0,200"], "prefix length 3 = 200 is not a multiple"),
    (RUN + ["--cp", "2", "--batch-size", "2"], "--batch-size is not supported with --cp"),
    (RUN + ["--top", "x"], "argument --top: invalid int value: 'x'"),
    (["run", "--model", "no-such-model", "--cp", "2"], "is neither a local checkpoint directory nor a bundled model"),
    (["plan", "--prefix", "-16,0", "--extend", "5,5"], "write --prefix=-16,0"),
    (["plan", "--extend", "5", "--cp", "0"], "cp_size must be >= 1, got 0"),
])
def test_run_and_plan_input_errors(capsys, no_spawn, argv, expected):
    line = user_error(capsys, argv)
    assert line.startswith(f"cpgraph {argv[0]}: error: ")
    assert expected in line
    assert "spawning" not in line


def test_out_of_vocabulary_prompt_under_cp_fails_in_the_parent(capsys, no_spawn, prompts_file):
    vocab = bundled_config_dict("tiny-glm5")["vocab_size"]
    path = prompts_file([[1, 2, 3], [4, vocab]])
    line = user_error(capsys, RUN + ["--cp", "2", "--prompts-file", path])
    assert f"prompt 1, position 1: token {vocab} is not an id in [0, {vocab})" in line


@pytest.mark.parametrize("argv, expected", [
    (["--prefix-lens", "5,0,0,0"], "prefix length 0 = 5 is not a multiple of the page size 16"),
    (["--prefix-lens", "16,0"], "prefix lengths have 2 entries for 4 prompts"),
    (["--chunk-tokens", "7"], "--chunk-tokens must be a multiple of the page size 16, got 7"),
    (["--page", "3"], "--page must be a power of two, got 3"),
    (["--group", "0"], "--group must be >= 1, got 0"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--json", "/nonexistent-dir/pd.json"], "does not exist"),
    (["--model", "tiny-nothing"], "'tiny-nothing' is neither a local checkpoint directory nor a bundled model"),
])
def test_pd_input_errors(capsys, no_spawn, argv, expected):
    line = user_error(capsys, ["pd", *argv])
    assert line.startswith("cpgraph pd: error: ") and expected in line


def test_pd_out_of_vocabulary_prompt(capsys, no_spawn, prompts_file):
    path = prompts_file([[1] * 40, [2] * 40, [3, 99999]])
    assert "token 99999 is not an id" in user_error(capsys, ["pd", "--prompts-file", path])


def test_pd_without_mooncake_fails_before_spawning(capsys, no_spawn, monkeypatch):
    import cpgraph.runtime.inputs as inputs

    monkeypatch.setattr(inputs, "MOONCAKE_MODULE", "cpgraph_no_such_mooncake")
    assert "Mooncake transfer engine" in user_error(capsys, ["pd", "--cp", "2"])


# ----------------------------------------------------------------------------- checkpoints


def _checkpoint(root, tensors=None):
    """A local checkpoint directory of tiny-glm5 (its config and weights)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(bundled_config_dict("tiny-glm5")))
    if tensors is None:
        tensors = {k: v.contiguous() for k, v in tiny_model("tiny-glm5").state_dict().items()}
    save_file(tensors, str(root / "model.safetensors"))
    return root


def test_truncated_safetensors(capsys, tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors" in user_error(capsys, ["run", "--model", str(root)])


def test_corrupt_safetensors_header(capsys, tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    (root / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "model.safetensors" in user_error(capsys, ["run", "--model", str(root)])


def test_index_weight_map_not_a_dict(capsys, tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert "weight_map" in user_error(capsys, ["run", "--model", str(root)])


def test_index_naming_a_shard_outside_the_checkpoint(capsys, tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    _checkpoint(tmp_path / "elsewhere")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "../elsewhere/model.safetensors"}}))
    user_error(capsys, ["run", "--model", str(root)])


def test_bad_config_json(capsys, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("{oops")
    assert "config.json: Expecting property name" in user_error(capsys, ["run", "--model", str(root), "--cp", "2"])
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    assert "unsupported model_type 'llama'" in user_error(capsys, ["run", "--model", str(root)])


def test_cp_run_parses_the_whole_config_before_spawning(capsys, no_spawn, tmp_path):
    cfg = bundled_config_dict("tiny-glm5")
    cfg["hidden_act"] = "gelu"  # the ranks would refuse it after loading
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = user_error(capsys, ["run", "--model", str(tmp_path), "--cp", "2"])
    assert "config.json" in line and "hidden_act 'gelu'" in line


# ----------------------------------------------------------------------------- not user errors


def test_a_bug_after_the_input_phase_keeps_its_traceback(monkeypatch):
    """Only input reading/checking maps to exit 2: a ValueError from the forward is a bug, not a user error."""
    import importlib

    prefill_mod = importlib.import_module("cpgraph.models.prefill")  # the package re-exports a function of that name

    def broken(*a, **k):
        raise ValueError("internal bug")

    monkeypatch.setattr(prefill_mod, "prefill", broken)
    with pytest.raises(ValueError, match="internal bug"):
        main(RUN + ["--quiet"])


def test_verbose_sets_the_cpgraph_logger_level(capsys):
    import logging

    log = logging.getLogger("cpgraph")
    before = log.level
    try:
        assert main(["-vv", "plan", "--extend", "5"]) == 0
        assert log.level == logging.DEBUG
        assert main(["plan", "-v", "--extend", "5"]) == 0
        assert log.level == logging.INFO
        assert main(["plan", "--extend", "5"]) == 0
        assert log.level == logging.WARNING
    finally:
        log.setLevel(before)


def test_cp_timing_line_separates_computed_and_cached_tokens():
    from cpgraph.cli_run_cp import cp_timing_line
    from cpgraph.runtime.cp_run import CPRunResult

    empty = torch.zeros(1, 1)
    res = CPRunResult(logits=empty, reference=empty, kv_bytes_per_rank=[], pages_per_rank=[], replicated_bytes=0,
                      seconds=2.0, compile_seconds=30.0, ranks_agree=True, tokens_computed=27, tokens_cached=256,
                      cache={})
    line = cp_timing_line(2, "cpu", "inductor", res)
    assert "computed 27 token(s) and took 256 from the prefix cache in 2.000 s" in line
    assert "283" not in line
    res.cache, res.tokens_computed, res.tokens_cached = None, 283, 0
    assert "283 tokens computed in 2.000 s" in cp_timing_line(2, "cpu", "inductor", res)


def test_check_request_as_a_library_call():
    from cpgraph.runtime.inputs import InputError, check_request

    req = check_request([(1, 2, 3), torch.tensor([4, 5])], [0, 0], vocab=10, page_size=16, cp=2)
    assert req.prompts == [[1, 2, 3], [4, 5]] and req.prefix_lens == [0, 0]
    for prompts, message in (([5], "prompt 0 must be a list of token ids"), ([[True]], "token True is not an id"),
                             ([[]], "prompt 0 is empty"), ([], "non-empty list")):
        with pytest.raises(InputError, match=message):
            check_request(prompts, None, vocab=10, page_size=16)

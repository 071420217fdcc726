"""``cpgraph run --cp 2``: spawns gloo ranks, writes the same JSON as a single-device run, reports progress.

The CP run's model is a local checkpoint of tiny-glm5 cut to two layers (a
dense layer with its indexer, a MoE layer sharing its top-k): each rank
compiles it, and compile time grows with the layers.
"""

from __future__ import annotations

import json
import queue
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import DSAConfig, build_model, from_pretrained, init_random, prefill_logits
from cpgraph.models.config import bundled_config_dict
from cpgraph.runtime import cp_run
from cpgraph.runtime.inputs import InputError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import _context as _fork_server_context  # noqa: E402


def ranks_from_the_fork_server(monkeypatch, module) -> None:
    """``module``'s ``mp.get_context("spawn")`` (cp_run, pd) becomes the suite's fork server (tests/dist_utils.py).

    A spawned rank is a fresh interpreter that imports torch and the compiler before it does anything (about
    5 CPU seconds each); a rank forked from the server starts with them imported.  It runs the same code on the
    same pickled arguments (the rank's function and its spec travel by pickle under either start method).
    """
    ctx = _fork_server_context()
    monkeypatch.setattr(module, "mp", SimpleNamespace(get_context=lambda method: ctx))


def _two_layer_checkpoint(root) -> str:
    """tiny-glm5 with two layers (dense + indexer, MoE + shared top-k) as a local checkpoint directory."""
    from safetensors.torch import save_file

    config = dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=2)
    model = init_random(build_model(DSAConfig.from_hf_dict(config)), seed=0, std=config["initializer_range"])
    assert model.config.mlp_layer_types == ("dense", "sparse") and model.config.indexer_types == ("full", "shared")
    root.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.mark.slow
def test_run_cp2_json_matches_single_device(tmp_path, capsys, monkeypatch):
    ranks_from_the_fork_server(monkeypatch, cp_run)
    out = tmp_path / "cp.json"
    ckpt = _two_layer_checkpoint(tmp_path / "ckpt")
    rc = main(["run", "--model", ckpt, "--prefix-lens", "64,0,0,16", "--cp", "2", "--backend", "aot_eager",
               "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "every rank holds the same logits: True" in text  # one gather: the same bytes on every rank
    # The CLI's ranks compute their own rows with the machine's GEMMs, whose bits depend on the row and
    # thread counts: CP equals one device to rounding, not bit for bit (docs/bitwise.md).
    rel = float(re.search(r"vs single-device eager: max \|diff\| \S+ \(relative (\S+)\)", text).group(1))
    assert rel <= 1e-5, text
    assert "rank 1: KV" in text and "of a replicated cache" in text
    model = from_pretrained(ckpt)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert f"; weights {weights} bytes" in text  # no expert parallelism: each rank holds the whole model
    assert text.count("op providers on cpu") == 1 and "  sparse_mla: reference " in text
    assert "283 tokens computed" in text
    # progress: each rank's compile, then rank 0's timed passes, in order
    err = captured.err
    assert "rank 1: compiling (aot_eager)" in err and "rank 1: compiled and ran in" in err
    assert err.index("rank 0: compiled and ran") < err.index("rank 0: timed run: extend pass") < err.index(
        "rank 0: single-device eager reference")
    data = json.loads(out.read_text())
    assert {"logits", "tokens", "top_ids", "kv_format", "prefix_lens"} <= data.keys()  # same keys as one device
    ref = prefill_logits(model, data["tokens"], prefix_lens=data["prefix_lens"])
    torch.testing.assert_close(torch.tensor(data["logits"]), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert sum(data["kv_bytes_per_rank"]) == data["replicated_kv_bytes"]
    assert data["computed_tokens"] == 283 and data["cached_tokens"] == 0
    assert data["weight_bytes_per_rank"] == [weights, weights]
    # the CP forward's ops, with the row compaction the CP passes add (a one-device run has none), all references here
    assert {"sparse_mla", "paged_store", "compact_valid_static", "restore_compute_static"} <= data["providers"].keys()
    assert set(data["providers"].values()) == {"reference"}
    # rank 0's calls (the compile run and the timed run): each op's calls computed by its reference, no fallback
    assert data["provider_calls"].keys() == data["providers"].keys()
    assert all([r["implementation"] for r in rows] == ["reference"] and rows[0]["calls"] >= 2 and rows[0]["reason"] is None
               for rows in data["provider_calls"].values())


@pytest.mark.slow
def test_cp2_cache_passes_in_graph_buckets(tmp_path, monkeypatch):
    """``run --cp 2 --cache --cuda-graphs`` (its ``CPRunSpec``; on CPU the buckets are padded, not captured): both
    cache passes run in row buckets on both ranks and still equal one device."""
    ranks_from_the_fork_server(monkeypatch, cp_run)
    ckpt = _two_layer_checkpoint(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 30)] + [
        torch.randint(0, 512, (21,), generator=g).tolist()]
    spec = cp_run.CPRunSpec(model=ckpt, prompts=prompts, prefix_lens=[0, 0, 0], cp=2, backend="aot_eager",
                            cache=True, cuda_graphs=True)
    res = cp_run.run_cp(spec)
    assert res.ranks_agree and res.cache["graph_buckets"] >= 2  # the cold pass and the warm (cache-hit) pass
    ref = res.reference
    tol = 1e-5 * ref.abs().max().item()
    torch.testing.assert_close(res.logits, ref, rtol=0, atol=tol)
    torch.testing.assert_close(res.cache["second"], ref, rtol=0, atol=tol)
    assert res.cache["hits"][1]["device"] > 0  # the warm pass read the shared prefix from the cache


@pytest.mark.slow
def test_checkpoint_error_in_the_ranks_is_one_line(tmp_path, capsys, monkeypatch):
    """The parent reads only config.json; a weight mismatch found by the ranks still ends as one line, exit 2."""
    ranks_from_the_fork_server(monkeypatch, cp_run)
    from safetensors.torch import save_file

    from cpgraph.models.config import bundled_config_dict

    (tmp_path / "config.json").write_text(json.dumps(bundled_config_dict("tiny-glm5")))
    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert main(["run", "--model", str(tmp_path), "--cp", "2", "--backend", "aot_eager", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpgraph run: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "not.a.weight" in err


def test_run_cp_rejects_bad_flags(capsys):
    assert main(["run", "--model", "tiny-glm5", "--backend", "aot_eager"]) == 2
    assert "--backend applies to CP runs" in capsys.readouterr().err
    assert main(["run", "--model", "tiny-glm5", "--cp", "0"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_single_device_cuda_without_a_gpu_is_one_line(capsys):
    assert main(["run", "--model", "tiny-glm5", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "cpgraph run: error: --device cuda: no CUDA device is visible\n"


class _Script:
    """A result queue that replays scripted messages; ``None`` stands for a poll that times out."""

    def __init__(self, items):
        self.items = list(items)

    def get(self, timeout=None):
        item = self.items.pop(0) if self.items else None
        if item is None:
            raise queue.Empty
        return item


class _Proc:
    def __init__(self, exitcode=None):
        self.exitcode = exitcode


def test_collect_forwards_phases_and_heartbeats():
    lines = []
    script = _Script([("phase", 0, "loading m"), None, ("phase", 1, "compiling"), None, ("ok", 0, "payload")])
    kind, rank, body = cp_run._collect([_Proc(), _Proc()], script, 60.0, lines.append, heartbeat=0.0)
    assert (kind, body) == ("ok", "payload")
    assert [ln.split(" s  ", 1)[1] for ln in lines] == [
        "rank 0: loading m", "waiting: rank 0 loading m, rank 1 starting",
        "rank 1: compiling", "waiting: rank 0 loading m, rank 1 compiling"]


def test_collect_without_heartbeat_prints_phases_only():
    lines = []
    script = _Script([None, ("phase", 0, "loading m"), None, None, ("ok", 0, "payload")])
    cp_run._collect([_Proc()], script, 60.0, lines.append, heartbeat=None)
    assert len(lines) == 1 and lines[0].endswith("rank 0: loading m")


def test_collect_notices_a_rank_that_died_silently():
    kind, rank, body = cp_run._collect([_Proc(), _Proc(exitcode=-9)], _Script([]), 60.0, None, None)
    assert (kind, rank) == ("error", 1) and "exited with status -9" in body["message"]


def test_rank_errors_while_reading_input_are_input_errors():
    err = cp_run._failure(0, dict(type="ValueError", message="bad\nweights", user=True, traceback="tb"))
    assert isinstance(err, InputError) and str(err) == "bad weights"
    err = cp_run._failure(1, dict(type="ValueError", message="bug", user=False, traceback="Traceback ..."))
    assert type(err) is RuntimeError and "rank 1: ValueError: bug" in str(err) and "Traceback" in str(err)

"""``cpgraph pd``: spawned prefill rank(s) + decode process, decode logits vs transformers 5.24."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine")

from cpgraph.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_cli_run_cp import _two_layer_checkpoint, ranks_from_the_fork_server  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--cp", "1", "--chunk-tokens", "32"], ["--cp", "2", "--prefix-lens", "32,0,0,64"]])
def test_pd(tmp_path, capsys, monkeypatch, argv):
    # --timeout is per stage; the prefill ranks' compile is one, and takes minutes on a loaded 2-core machine.
    # The CP case runs a local two-layer tiny-glm5 checkpoint (dense + indexer, MoE + shared top-k): every
    # layer kind, half the compile; the decode side's transformers reference reads its config.json.
    from cpgraph.transfer import pd

    ranks_from_the_fork_server(monkeypatch, pd)  # the prefill ranks and the decode process
    out = tmp_path / "pd.json"
    model = ["--model", _two_layer_checkpoint(tmp_path / "ckpt")] if "--cp" in argv and argv[argv.index("--cp") + 1] != "1" else []
    assert main(["pd", *argv, *model, "--quiet", "--json", str(out), "--timeout", "300"]) == 0
    data = json.loads(out.read_text())
    assert data["max_abs_diff"] <= 1e-4 and data["statuses"] == [4] * 8 and data["bytes_sent"] > 0
    text = capsys.readouterr().out
    assert "GB/s" in text and "hidden behind the forward" in text


def test_pd_bad_input(capsys):
    assert main(["pd", "--cp", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--cp must be >= 1" in err and err.count("\n") == 1

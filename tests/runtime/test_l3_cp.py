"""``cpgraph run --cp 2 --cache --l3 file:DIR`` twice: the second run's fresh ranks serve the first run's prefixes.

Each rank stores only the pages it owns, keyed with (cp size, its rank);
the second run's ranks find each page's owner with one all-gather and fetch
their own pages.  One run pair on a one-layer checkpoint (dense, with its
indexer: the L3 path does not depend on the layer kinds; aot_eager, and the
compile is still most of the time).  The runs' logits are compared with a
tolerance (the warm run computes fewer rows: other GEMM shapes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cpgraph.cli import main
from cpgraph.runtime import cp_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_cli_run_cp import ranks_from_the_fork_server  # noqa: E402

pytestmark = pytest.mark.slow


def _one_layer_checkpoint(root) -> str:
    from safetensors.torch import save_file

    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.config import bundled_config_dict

    config = dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=1)
    model = init_random(build_model(DSAConfig.from_hf_dict(config)), seed=0, std=config["initializer_range"])
    root.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_cp2_second_run_restores_owned_pages_from_l3(tmp_path, capsys, monkeypatch):
    ranks_from_the_fork_server(monkeypatch, cp_run)  # each run's ranks: new processes, forked from the server
    ckpt = _one_layer_checkpoint(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (48,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 9)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    store = tmp_path / "l3"
    outs = []
    for n in (1, 2):
        out = tmp_path / f"run{n}.json"
        assert main(["run", "--model", ckpt, "--prompts-file", str(tmp_path / "prompts.json"), "--cache",
                     "--l3", f"file:{store}", "--cp", "2", "--backend", "aot_eager", "--json", str(out),
                     "--quiet"]) == 0
        outs.append((capsys.readouterr().out, json.loads(out.read_text())))
    (text1, one), (text2, two) = outs
    assert one["hits"][0] == {"device": 0, "host": 0, "l3": 0, "computed": 88 + 57}
    # run 2, pass 1: request 0 fetches its 5 whole pages from L3 (loaded into L1 before request 1 matches them)
    assert two["hits"][0] == {"device": 48, "host": 0, "l3": 80, "computed": 8 + 9}
    assert "L3 (store) hit 80 token(s)" in text2 and "every rank holds the same logits: True" in text2
    # each rank read only the pages it owns: rank 0's store served some, not all, of the 5
    assert two["l3"]["fetched_pages"] == 5 and two["l3"]["fetch_failed_pages"] == 0
    assert 0 < two["l3"]["store_stats"]["get_pages"] < 5
    np.testing.assert_allclose(two["logits"], one["logits"], rtol=0, atol=1e-5)
    assert two["max_abs_diff_vs_single_device"] <= 1e-5


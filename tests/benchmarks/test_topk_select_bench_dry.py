"""benchmarks/topk_select_bench.py on CPU: its sweep's variants are valid tunings and ``--write-tuning`` round-trips.

The timing itself needs a GPU; what a GPU session would trip over first is checked here: every --sweep variant
has one field per tuning name and ``set_tuning`` accepts it, and the file ``--write-tuning`` writes is read back
by ``CPGRAPH_INDEXER_TUNING`` as the same tuning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import topk_select_bench as bench  # noqa: E402

from cpgraph.kernels import indexer as ki  # noqa: E402


def test_sweep_variants_are_valid_tunings():
    assert len(set(bench.SWEEP)) == len(bench.SWEEP)
    assert set(bench.TUNING_NAMES) <= set(ki.tuning())
    saved = ki.tuning()
    try:
        for v in bench.SWEEP:
            ki.set_tuning(**bench.variant_tuning(v))  # raises on a wrong name, type or value
    finally:
        ki.set_tuning(**saved)
    assert any(bench.variant_tuning(v)["SELECT_LIST_STEP"] for v in bench.SWEEP)
    with pytest.raises(ValueError, match="fields"):
        bench.variant_tuning(bench.SWEEP[0][:-1])


def test_write_tuning_round_trips(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    saved = ki.tuning()
    try:
        for v in (bench.SWEEP[-1], bench.SWEEP[0]):
            written = bench.write_tuning(path, list(v))  # the sweep's results hold variants as JSON lists
            monkeypatch.setenv("CPGRAPH_INDEXER_TUNING", str(path))
            ki._tuning_from_env()
            assert {k: ki.tuning()[k] for k in bench.TUNING_NAMES} == written == bench.variant_tuning(v)
    finally:
        ki.set_tuning(**saved)


@pytest.mark.skipif(bool(os.environ.get("CPGRAPH_INDEXER_TUNING")), reason="a tuning file replaces the defaults")
def test_first_variant_is_the_default_tuning():
    """A run without --sweep times SWEEP[0] as "the default", and --stages cuts it: it must be the tuning in use."""
    assert bench.variant_tuning(bench.SWEEP[0]) == {k: ki.tuning()[k] for k in bench.TUNING_NAMES}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU exit")
def test_needs_a_gpu_to_time():
    assert bench.main([]) == 2

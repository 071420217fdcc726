"""benchmarks/deep_gemm_bench.py without a GPU: it refuses in one line, and bad sections are argument errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import deep_gemm_bench  # noqa: E402


def test_unknown_section_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exc:
        deep_gemm_bench.main(["--sections", "grouped,attention"])
    assert exc.value.code == 2
    assert "unknown sections ['attention']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU sees")
def test_without_a_gpu_it_refuses_in_one_line(capsys):
    assert deep_gemm_bench.main(["--sections", "dense"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA GPU" in err

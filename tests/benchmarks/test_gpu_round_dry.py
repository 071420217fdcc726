"""``benchmarks/gpu_round.sh`` (the GPU session's batched runs) parses, and a wrong stage is a one-line error."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_round.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_script_parses_and_names_the_files_it_runs(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    root = SCRIPT.parents[1]
    for path in ("benchmarks/topk_select_bench.py", "benchmarks/production_shape.py", "benchmarks/serve_bench.py",
                 "benchmarks/sass_loops.py", "benchmarks/fp8_linear_bench.py", "benchmarks/deep_gemm_bench.py",
                 "benchmarks/swiglu_bench.py", "benchmarks/norm_quant_bench.py", "benchmarks/indexer_bench.py", "tests/kernels/test_indexer_kernels.py", "tests/serve/test_serve_gpu.py",
                 "tests/runtime/test_bucket_padding_cp.py"):
        assert path in text and (root / path).is_file(), path
    for test in ("test_cp2_cuda_graph_server_replays_and_matches_prefill_logits",
                 "test_cuda_capture_pads_a_cached_prefix_under_cp"):
        assert test in text and any(f"def {test}(" in p.read_text() for p in (root / "tests").rglob("test_*.py"))


def test_unknown_stage_is_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "unknown stage nonsense" in proc.stderr

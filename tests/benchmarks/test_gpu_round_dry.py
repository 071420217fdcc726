"""``benchmarks/gpu_round.sh`` (the GPU session's batched runs) parses, and a wrong stage is a one-line error."""

from __future__ import annotations

import os
import signal
import shutil
import subprocess
import tarfile
import time
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


def _out_with(tmp_path, n: int) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for i in range(n):
        (out / f"step{i}.log").write_text(f"log {i}\n")
    return out


def _env(out: Path, python3: str) -> dict:
    """Every step skipped (``STEPS``), and ``python3`` (the wheels' install and probe, all that is left) replaced by
    a stand-in: no GPU stack needed, and a probe that takes as long as the test needs."""
    bin_dir = out.parent / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\n{python3}\n")
    (bin_dir / "python3").chmod(0o755)
    return {**os.environ, "OUT": str(out), "STEPS": "none_of_them", "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_more_than_eight_files_are_packed_at_the_end(tmp_path):
    out = _out_with(tmp_path, 10)
    proc = subprocess.run(["bash", str(SCRIPT), "cp2"], capture_output=True, text=True,
                          env=_env(out, "echo probe"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["round.tgz"]
    with tarfile.open(out / "round.tgz") as tar:
        assert sorted(n.removeprefix("./") for n in tar.getnames()) == sorted(f"step{i}.log" for i in range(10))


def test_a_stopped_call_still_packs_what_it_measured(tmp_path):
    """``timeout`` stops the script's process group with SIGTERM: the trap packs $OUT before exiting."""
    out = _out_with(tmp_path, 9)
    proc = subprocess.Popen(["bash", str(SCRIPT), "cp2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(out, "exec sleep 60"), start_new_session=True)
    time.sleep(1.0)  # the script is in its (60 s) probe when the signal comes
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert sorted(p.name for p in out.iterdir()) == ["round.tgz"]
    assert proc.returncode == 124 and "stopped by a signal" in stdout, (proc.returncode, stdout)

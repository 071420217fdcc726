"""Deterministic prefill under CP over NCCL: cp = 2, 4, 8 give the one-device eager bits (skips without the GPUs).

The path ``cpgraph run --cp N --device cuda --deterministic`` takes
(:func:`cpgraph.runtime.cp_run.run_cp` with ``deterministic=True``): N
spawned ranks, one GPU each, compile the mid-sized DSA of
``test_deterministic_gpu.py`` with ``CPConfig(cp_size=N, deterministic=True)``
and prefill a batch with cached prefixes; rank 0 runs the one-device eager
reference inside the mode.  Every rank's logits equal the reference bit for
bit, and so do the radix-cache warm pass's (a cache hit on every request).
KV bytes across CP sizes are compared by the gloo test on CPU
(``test_deterministic_cp.py``).  Run on the multi-GPU machines by::

    TORCHINDUCTOR_FX_GRAPH_CACHE=0 python -m pytest -q tests/determinism/test_deterministic_nccl.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_bf16_checkpoint(root: Path, d: dict, seed: int = 0) -> None:
    """A seeded cpgraph model saved as a transformers-layout checkpoint (routed experts one per entry)."""
    from safetensors.torch import save_file

    from cpgraph.models import DSAConfig, build_model, init_random

    model = init_random(build_model(DSAConfig.from_hf_dict(d), torch.bfloat16), seed=seed, std=0.05)
    tensors = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            base, kind = k.rsplit(".", 1)
            for j in range(v.shape[0]):
                parts = v[j].chunk(2) if kind == "gate_up_proj" else (v[j],)
                names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for name, part in zip(names, parts):
                    tensors[f"{base}.{j}.{name}.weight"] = part.contiguous()
        else:
            tensors[k] = v.contiguous()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(dict(d, torch_dtype="bfloat16")))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_nccl_cp_equals_one_device_bit_for_bit(tmp_path, cp, backend):
    if not torch.cuda.is_available() or torch.cuda.device_count() < cp:
        pytest.skip(f"needs {cp} CUDA devices")
    from test_deterministic_gpu import COMPOSITIONS, PAGE, medium_config

    from cpgraph.runtime.cp_run import CPRunSpec, run_cp

    write_bf16_checkpoint(tmp_path, medium_config())
    prompts, prefix, _ = COMPOSITIONS[2]  # four requests, a cached prefix: both passes batch two or more
    for cache in (False, True):
        spec = CPRunSpec(model=str(tmp_path), prompts=prompts, prefix_lens=None if cache else prefix, cp=cp,
                         device="cuda", dtype="bfloat16", backend=backend, page_size=PAGE, cache=cache,
                         deterministic=True)
        res = run_cp(spec, timeout=1800.0)
        assert res.ranks_agree
        got, want = np.asarray(res.logits), np.asarray(res.reference)
        assert np.array_equal(got, want), f"cp={cp} {backend} cache={cache}: max |diff| {np.abs(got - want).max()}"
        if cache:
            assert np.array_equal(np.asarray(res.cache["second"]), got), f"cp={cp} {backend}: warm pass"

"""Where kernel tests run: CPU tensors under ``TRITON_INTERPRET=1``, else CUDA, else they skip.

One definition for every test file that runs Triton providers (tests/kernels/ and the op tests
that exercise a provider), so the rule cannot drift between them.
"""

from __future__ import annotations

import os

import pytest
import torch


def kernel_device() -> str | None:
    """``"cpu"`` when the Triton interpreter is on, ``"cuda"`` on a GPU machine, else ``None``."""
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


needs_kernels = pytest.mark.skipif(kernel_device() is None, reason="needs TRITON_INTERPRET=1 or a CUDA device")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

"""Where the kernel tests run: CPU tensors under ``TRITON_INTERPRET=1``, else CUDA, else skip."""

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


@pytest.fixture
def device() -> str:
    dev = kernel_device()
    if dev is None:
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
    return dev

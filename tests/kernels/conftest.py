"""Where the kernel tests run: CPU tensors under ``TRITON_INTERPRET=1``, else CUDA, else skip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import kernel_device  # noqa: E402,F401  (tests here import it from conftest)


@pytest.fixture
def device() -> str:
    dev = kernel_device()
    if dev is None:
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
    return dev

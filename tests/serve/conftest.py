"""Fixtures shared by the in-process serve tests."""

from __future__ import annotations

import pytest
import torch

from cpgraph.models import from_pretrained
from cpgraph.models.prefill import make_layout

PAGE = 16  # the page size of the shared ``model``


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: the 2-core CI machine runs the engine and the client side by side."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    """tiny-glm5 with a bf16 layout of ``PAGE``-token pages."""
    m = from_pretrained("tiny-glm5").eval()
    m.kv_layout = make_layout(m, "bf16", PAGE)
    return m

"""First-use provider binding (``cpgraph.ops.providers``): when a device's binder runs, and what it may not do.

The binder is faked for a device type nothing else uses, so these tests run in any process and
leave the real ``"cuda"`` registry alone.  That ``import cpgraph.ops`` binds nothing at all (no
Triton, no kernel module) is checked in a fresh interpreter by tests/test_imports.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import cpgraph.kernels as kernels
import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops import providers

DEV = "binding_test_device"


def _take_rows(x, index):
    return x[index]


@pytest.fixture
def binder(monkeypatch):
    """A fake ``cpgraph.kernels.bind`` for ``DEV``; yields its call log (``.fail`` / ``.delay`` steer it)."""

    class Binder:
        calls: list = []
        fail = False
        delay = 0.0

        def __call__(self, device_type):
            self.calls.append(device_type)
            time.sleep(self.delay)
            if self.fail:
                raise RuntimeError("binder failed")
            providers.register_provider("take_rows", device_type, "bound", _take_rows)
            return ["take_rows"]

    fake = Binder()
    fake.calls = []
    monkeypatch.setattr(kernels, "bind", fake)
    monkeypatch.setattr(providers, "BINDABLE", providers.BINDABLE + (DEV,))
    monkeypatch.setattr(providers, "_BOUND_DEVICES", set(providers._BOUND_DEVICES))
    monkeypatch.delenv("CPGRAPH_PROVIDERS", raising=False)
    yield fake
    for by_dev in providers._PROVIDERS.values():
        by_dev.pop(DEV, None)


def test_the_first_select_binds_the_device_once(binder):
    assert providers.select("take_rows", DEV, _take_rows).name == "bound"
    assert providers.select("take_rows", DEV, _take_rows).name == "bound"
    assert providers.active_provider("take_rows", DEV) == "bound"
    assert binder.calls == [DEV]


def test_a_registration_before_first_use_is_not_overwritten(binder):
    """The device binds before the registration, so the hand-registered provider is the one that stays."""
    providers.register_provider("take_rows", DEV, "mine", _take_rows)
    assert binder.calls == [DEV]
    assert providers.select("take_rows", DEV, _take_rows).name == "mine"
    providers.unregister_provider("take_rows", DEV)
    assert providers.active_provider("take_rows", DEV) == providers.REFERENCE  # not re-bound behind our back
    assert binder.calls == [DEV]


def test_forced_reference_binds_nothing(binder, monkeypatch):
    monkeypatch.setenv("CPGRAPH_PROVIDERS", "reference")
    assert providers.select("take_rows", DEV, _take_rows).name == providers.REFERENCE
    assert providers.active_provider("take_rows", DEV) == providers.REFERENCE
    assert binder.calls == []


def test_a_failed_binding_raises_at_every_use(binder):
    """No silent fallback: a binder that raises leaves the device unbound, so the next use raises too."""
    binder.fail = True
    for _ in range(2):
        with pytest.raises(RuntimeError, match="binder failed"):
            providers.select("take_rows", DEV, _take_rows)
    assert binder.calls == [DEV, DEV]
    binder.fail = False
    assert providers.select("take_rows", DEV, _take_rows).name == "bound"


def test_bind_providers_binds_now_and_returns_the_registry(binder):
    assert providers.bind_providers(DEV) == {"take_rows": "bound"}
    assert providers.bind_providers(DEV) == {"take_rows": "bound"}
    assert binder.calls == [DEV]
    assert cpgraph.ops.bind_providers is providers.bind_providers


def test_a_device_without_a_binder_keeps_its_registrations(binder):
    before = providers.bind_providers("cpu")
    assert binder.calls == []  # only bindable devices call the binder
    assert providers.bind_providers("cpu") == before


def test_concurrent_first_uses_bind_once_and_see_the_whole_binding(binder):
    binder.delay = 0.2
    names = []
    threads = [threading.Thread(target=lambda: names.append(providers.select("take_rows", DEV, _take_rows).name))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert binder.calls == [DEV] and names == ["bound"] * 3


def test_the_op_runs_the_bound_provider(binder, monkeypatch):
    """Through the op body: ``select`` is what binds, so dispatching on a device's tensor binds it."""
    seen = []
    monkeypatch.setattr(providers, "BINDABLE", ("cpu", DEV))
    monkeypatch.setattr(providers, "_BOUND_DEVICES", set())
    saved = providers._PROVIDERS.get("take_rows", {}).get("cpu")

    def bind(device_type):
        seen.append(device_type)
        providers.register_provider("take_rows", device_type, "bound", _take_rows)

    monkeypatch.setattr(kernels, "bind", bind)
    try:
        x = torch.arange(6.0).reshape(3, 2)
        out = torch.ops.cpgraph.take_rows(x, torch.tensor([2, 0]))
        assert torch.equal(out, x[[2, 0]]) and seen == ["cpu"]
        assert providers.active_provider("take_rows", "cpu") == "bound"
    finally:
        providers.unregister_provider("take_rows", "cpu")  # (also drops the counts of the "bound" calls)
        if saved is not None:
            providers.register_provider("take_rows", "cpu", *saved)

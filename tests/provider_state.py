"""Keep the process's provider registry as a test found it.

Tests that register or unregister providers for a device must put back what was there: on a GPU
machine the suite runs many files in one process, and a test that unregistered every CUDA provider
on its way out made later files compute with the references (and fail their provider checks).
"""

from __future__ import annotations

import contextlib

from cpgraph.ops import providers


@contextlib.contextmanager
def registry_restored(*device_types: str):
    """On exit, the registrations of ``device_types`` are exactly what they were on entry.

    Each device is bound first (``bind_providers``): "what was there" is then its providers, so a
    device whose first use falls inside the block is not left bound with its registry emptied.
    """
    for d in device_types:
        providers.bind_providers(d)
    saved = {op: {d: by_dev[d] for d in device_types if d in by_dev} for op, by_dev in providers._PROVIDERS.items()}
    try:
        yield
    finally:
        for op, by_dev in providers._PROVIDERS.items():
            for d in device_types:
                if d in by_dev and d not in saved.get(op, {}):
                    providers.unregister_provider(op, d)
        for op, by_dev in saved.items():
            for d, (name, fn) in by_dev.items():
                if providers._PROVIDERS.get(op, {}).get(d) != (name, fn):
                    providers.register_provider(op, d, name, fn)

"""Refusing a model that cannot fit before any of it is allocated.

A checkpoint too large for the device or the host would otherwise fail deep
in an allocation (or get the process killed) after minutes of reading;
:func:`check_memory` compares :func:`estimate_model_bytes` (computed on the
meta device) plus the checkpoint bytes staged in host RAM with the memory
available, which ``memory_limit`` / ``CPGRAPH_MEMORY_LIMIT`` override (see
``docs/models.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from .build import _keeps_fp32, resolve_dtype
from .config import DSAConfig
from .model import DecoderLayer, DSAForCausalLM

MEMORY_LIMIT_ENV = "CPGRAPH_MEMORY_LIMIT"

# The warnings are from_pretrained's: logged under the loader's name, as before the split.
log = logging.getLogger(__package__ + ".loading")


def estimate_model_bytes(cfg: DSAConfig, dtype=torch.float32) -> int:
    """Bytes ``build_model(cfg, dtype)`` allocates (parameters and buffers), without allocating them.

    Builds one decoder layer of each (MLP kind, indexer kind) on the meta
    device and multiplies by the number of such layers, so the cost does not
    grow with the layer count and the module code stays the one source of
    truth for shapes.
    """
    dtype = resolve_dtype(dtype)

    def nbytes(module, prefix: str) -> int:
        total = 0
        for name, p in module.named_parameters():
            size = 4 if _keeps_fp32(prefix + name) else dtype.itemsize
            total += p.numel() * (size if p.dtype.is_floating_point else p.element_size())
        return total + sum(b.numel() * b.element_size() for b in module.buffers())

    kinds: dict[tuple[str, str], list[int]] = {}
    for i, kind in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types)):
        kinds.setdefault(kind, []).append(i)
    try:
        with torch.device("meta"):
            total = nbytes(DSAForCausalLM(dataclasses.replace(cfg, num_hidden_layers=0, mlp_layer_types=(),
                                                              indexer_types=())), "")
            for layers in kinds.values():
                total += len(layers) * nbytes(DecoderLayer(cfg, layers[0]), f"model.layers.{layers[0]}.")
    except (RuntimeError, OverflowError) as exc:
        raise ValueError(f"the config describes tensors too large to build: {str(exc).splitlines()[0]}") from None
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def _host_available() -> int | None:
    """Available host RAM (Linux ``MemAvailable``), or ``None`` when the platform does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _memory_limit(memory_limit):
    """``None`` (detect), ``"off"``, or a byte count, from the argument or else ``CPGRAPH_MEMORY_LIMIT``."""
    source = "memory_limit"
    if memory_limit is None:
        memory_limit = os.environ.get(MEMORY_LIMIT_ENV) or None
        source = MEMORY_LIMIT_ENV
        if isinstance(memory_limit, str) and memory_limit.strip().isdigit():
            memory_limit = int(memory_limit.strip())
    if memory_limit is None or memory_limit == "off":
        return memory_limit
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < 1:
        raise ValueError(f"{source} must be a positive number of bytes or 'off', got {memory_limit!r}")
    return memory_limit


def check_memory(cfg: DSAConfig, dtype, device, *, staged_bytes: int = 0, memory_limit=None, what: str = "model",
                 saved_bytes: int = 0) -> int:
    """Refuse (``ValueError``) before allocating when the model cannot fit; returns the estimated model bytes.

    ``staged_bytes``: checkpoint bytes held in host RAM while loading (the
    loader reads every tensor before copying any, so a failed load changes
    nothing).  On ``cuda`` the model must fit the device's free memory and the
    staged checkpoint the host's; on ``cpu`` both share host RAM.
    ``memory_limit`` (bytes) replaces the detected amounts; ``"off"`` skips
    the check.  ``saved_bytes``: what FP8 weights save against ``dtype``.
    """
    limit = _memory_limit(memory_limit)
    need = estimate_model_bytes(cfg, dtype) - saved_bytes  # saved_bytes: FP8 weights kept at 1 byte
    if limit == "off":
        return need
    dev = torch.device(device)
    if dev.type == "meta":
        return need
    checks = []  # (bytes needed, where, available)
    if dev.type == "cuda":
        if limit is None:
            free, _ = torch.cuda.mem_get_info(dev)
        checks.append((need, f"device memory on {dev}", limit if limit is not None else free))
        if staged_bytes:
            checks.append((staged_bytes, "host RAM (checkpoint staging)", limit if limit is not None else _host_available()))
    elif dev.type == "cpu":
        checks.append((need + staged_bytes, "host RAM", limit if limit is not None else _host_available()))
    else:
        if limit is None:
            log.warning("from_pretrained: no memory check for device type %r (cannot query its free memory)", dev.type)
            return need
        checks.append((need, f"memory on {dev}", limit))
    for want, where, available in checks:
        if available is None:
            log.warning("from_pretrained: cannot tell how much %s is available; skipping the memory check", where)
            continue
        if want > available:
            detail = f"{need} bytes of weights in {resolve_dtype(dtype)}"
            if staged_bytes and "host" in where:
                detail += f" + {staged_bytes} bytes of checkpoint read before copying"
            raise ValueError(
                f"{what} needs about {_gib(want)} of {where} ({detail}) but {_gib(available)} is available; "
                f"use a smaller dtype, or override with memory_limit= / {MEMORY_LIMIT_ENV}=BYTES|off"
            )
    return need

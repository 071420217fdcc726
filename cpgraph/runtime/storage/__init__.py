"""HiCache L3: persistent, shareable page storage behind one small interface.

* :class:`PageStore` (``base``): page-granular batch ``exists`` / ``get`` /
  ``put`` into registered host buffers; failures are misses, never
  exceptions.
* :mod:`.keys`: chain-hash page keys bound to a fingerprint of the model,
  its weights, the KV format, page size and CP layout.
* :class:`FileStore` (``file:DIR``, the embedded default) and
  :class:`MooncakeStore` (``mooncake:HOST:PORT``).

:func:`open_store` turns a spec string (what ``cpgraph run --l3`` takes)
into a store.  The tier logic that uses a store -- what to look up, fetch
into L2 and write back -- is :mod:`cpgraph.runtime.l3`.
"""

from __future__ import annotations

from ..hicache import WRITE_POLICIES
from .base import PageStore, Parts, check_parts
from .file_store import FileStore, parse_size
from .keys import KEY_FORMAT_VERSION, page_chain, page_key, store_fingerprint, weights_identity
from .mooncake_store import MooncakeStore

__all__ = ["KEY_FORMAT_VERSION", "FileStore", "MooncakeStore", "PageStore", "Parts", "SpecError", "check_parts",
           "open_store", "page_chain", "page_key", "parse_spec", "parse_size", "store_fingerprint",
           "weights_identity"]

BACKENDS = ("file", "mooncake")
# Options each backend takes in a spec, with their converters.
_OPTIONS = {
    "file": {"max_bytes": parse_size, "threads": int},
    "mooncake": {"metadata": str, "host": str, "protocol": str, "device": str, "segment": parse_size,
                 "buffer": parse_size},
}
# Options of the tier, not of the backend (see cpgraph.runtime.l3.L3Config.from_spec).
TIER_OPTIONS = ("policy",)
POLICIES = WRITE_POLICIES  # L3 takes the L2 policies' names


class SpecError(ValueError):
    """A malformed L3 spec (one line, for the CLI)."""


def parse_spec(spec: str) -> tuple[str, str, dict]:
    """``"file:/d,max_bytes=2G"`` -> ``("file", "/d", {"max_bytes": 2147483648})`` (options converted).

    Grammar: ``BACKEND:LOCATION[,NAME=VALUE]...`` -- ``file:DIR`` or
    ``mooncake:HOST:PORT`` (the master).  Tier options (``policy=``) are
    returned as given, for :class:`~cpgraph.runtime.l3.L3Config`.
    """
    backend, sep, rest = str(spec).partition(":")
    if not sep or backend not in BACKENDS:
        raise SpecError(f"L3 spec {spec!r}: expected file:DIR or mooncake:HOST:PORT (backends: {', '.join(BACKENDS)})")
    location, *opts = rest.split(",")
    if not location:
        raise SpecError(f"L3 spec {spec!r}: the {backend} backend needs a location after '{backend}:'")
    options = {}
    for opt in opts:
        name, eq, value = opt.partition("=")
        name = name.strip()
        if not eq or not name:
            raise SpecError(f"L3 spec {spec!r}: option {opt!r} is not NAME=VALUE")
        if name in TIER_OPTIONS:
            if value not in POLICIES:
                raise SpecError(f"L3 spec {spec!r}: policy must be one of {', '.join(POLICIES)}, got {value!r}")
            options[name] = value
            continue
        conv = _OPTIONS[backend].get(name)
        if conv is None:
            known = ", ".join(sorted(_OPTIONS[backend]) + list(TIER_OPTIONS))
            raise SpecError(f"L3 spec {spec!r}: unknown option {name!r} for {backend} (known: {known})")
        try:
            options[name] = conv(value)
        except ValueError as exc:
            raise SpecError(f"L3 spec {spec!r}: option {name}: {exc}") from None
    return backend, location, options


def open_store(spec: str) -> PageStore:
    """The store a spec names (tier options such as ``policy=`` are ignored here)."""
    backend, location, options = parse_spec(spec)
    options = {k: v for k, v in options.items() if k not in TIER_OPTIONS}
    if backend == "file":
        return FileStore(location, **options)
    return MooncakeStore(location, **options)

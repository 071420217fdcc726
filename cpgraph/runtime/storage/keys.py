"""L3 object keys: a chain hash over the token pages, bound to a fingerprint of what produced the bytes.

What a key protects against:

* **another prefix.**  A page's bytes depend on every token before it, not
  only its own: its chain digest is ``sha256(previous page's digest | this
  page's token ids)``, so two prompts share a page's key only when they
  share the whole prefix up to that page's end.  With the MTP draft layer in
  the pool the page's last draft row also depends on the *next* token (the
  first token of the following page, docs/mtp.md), so that token is hashed
  into the page's digest too.
* **another model, format or layout.**  :func:`store_fingerprint` hashes
  the model config, the weights' identity, the KV and index-K formats, the
  model dtype, the page size, the pool's payloads (logical layer ids and
  bytes per page, which fixes the object's byte layout) and a format
  version.  A different model, a fine-tune with the same architecture, an
  fp8 cache or another page size gets other keys and never reads these
  objects; the same model on another instance (or after a restart) gets the
  same keys and shares them.
* **another CP layout.**  Under CP every page is stored by the rank that
  owns it, keyed with ``(cp size, owner rank)``: bytes computed at another CP
  size (other GEMM shapes, other owners) are never mixed in, and each rank
  reads only the pages it stored under its rank.

The weights' identity (:func:`weights_identity`) hashes every parameter's
and buffer's name, dtype, shape and an evenly strided sample of its values
(up to 256 per tensor) -- enough to tell two checkpoints apart without
reading every byte of a large model at start-up.  A caller that knows a
better identity (a checkpoint's content hash) passes it instead.
Keys are 64 hex digits (sha256), so no token id appears in a file name or a
Mooncake key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np
import torch

# Bump when the object layout or the key derivation changes: old objects then simply miss.
KEY_FORMAT_VERSION = 1
_SAMPLES_PER_TENSOR = 256


def weights_identity(model) -> str:
    """sha256 over each parameter/buffer's name, dtype, shape and a strided sample of its values."""
    h = hashlib.sha256()
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in sorted(named, key=lambda nt: nt[0]):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step][:_SAMPLES_PER_TENSOR].cpu()  # sync-ok (start-up: a few hundred values per tensor)
        if sample.dtype.is_floating_point and sample.dtype.itemsize == 1:
            sample = sample.view(torch.uint8)  # fp8 weights: hash their bits
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(sample.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def store_fingerprint(model_config: dict, weights_id: str, pool_config, payloads: Sequence[tuple], cp_size: int) -> str:
    """sha256 naming everything an L3 page's bytes depend on besides its tokens and owner (module docstring).

    ``pool_config``: the :class:`~cpgraph.runtime.kv_pool.KVPoolConfig`;
    ``payloads``: ``[((kind, layer), bytes_per_page), ...]`` in object order.
    """
    desc = {
        "version": KEY_FORMAT_VERSION,
        "model": model_config,
        "weights": weights_id,
        "kv_format": pool_config.kv_format,
        "index_format": pool_config.index_kind,
        "dtype": str(pool_config.dtype),
        "page_size": int(pool_config.page_size),
        "payloads": [[kind, int(layer), int(nb)] for (kind, layer), nb in payloads],
        "cp_size": int(cp_size),
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()


def page_chain(tokens: Sequence[int], page_size: int, num_pages: int, *, with_next_token: bool = False) -> list[bytes]:
    """Chain digests of the first ``num_pages`` whole pages of ``tokens`` (32 bytes each).

    ``with_next_token``: also hash the token after each page (the draft
    layer's dependency); page ``j`` then needs ``tokens[(j + 1) * page_size]``.
    """
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).astype("<i4"))
    need = num_pages * page_size + (1 if with_next_token and num_pages else 0)
    if arr.shape[0] < need:
        raise ValueError(f"page_chain: {num_pages} page(s) of {page_size} need {need} tokens, got {arr.shape[0]}")
    raw = arr.tobytes()
    out, prev, pb = [], b"", page_size * 4
    for j in range(num_pages):
        h = hashlib.sha256(prev)
        h.update(raw[j * pb : (j + 1) * pb])
        if with_next_token:
            h.update(b"|next|" + raw[(j + 1) * pb : (j + 1) * pb + 4])
        prev = h.digest()
        out.append(prev)
    return out


def page_key(fingerprint: str, digest: bytes, owner: int) -> str:
    """The store key of one page: the fingerprint, its owner rank and its chain digest, hashed (64 hex)."""
    h = hashlib.sha256(fingerprint.encode())
    h.update(int(owner).to_bytes(2, "little"))
    h.update(digest)
    return h.hexdigest()

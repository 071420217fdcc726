"""Checks on a decode's REGISTER frame, before a prefill rank accepts a room.

Why a separate module: these are the rules that stop one client's frame
from steering the prefill's writes somewhere else (see ``docs/security.md``):

* the KV layout must match ours (fingerprint and geometry, ``layout.py``);
* the session the KV goes to must be on the host the REGISTER came from, so
  a client cannot point a prefill at a third process's engine (opt out with
  ``allow_foreign_session`` when decode's control and data interfaces differ);
* every destination page must exist in decode's pool (``0 <= p <
  num_pages``, no page twice) and the table must cover the prompt
  (``ceil(prompt_len / page_size)`` pages) but hold at most
  ``max_room_pages`` entries -- so a send can never address memory outside
  the buffers decode registered, and the stored table is bounded;
* the aux record must fit, and no base pointer plus pool size overflows.

All checks are pure; :class:`~cpgraph.transfer.prefill.PrefillPeer` holds the
state (who owns which room, capacity).
"""

from __future__ import annotations

import numpy as np

from .layout import PoolLayout
from .sender import AUX_BYTES

DEFAULT_MAX_ROOMS = 256
DEFAULT_MAX_ROOM_PAGES = 1 << 15
_ADDRESS_LIMIT = 1 << 63


def remote_layout(msg: dict) -> PoolLayout:
    return PoolLayout(msg["fingerprint"], msg["page_size"], tuple(msg["mla_ptrs"]), msg["mla_page_bytes"],
                      tuple(msg["index_layers"]), tuple(msg["index_ptrs"]), msg["index_page_bytes"])


def session_problem(session: str, peer_host: str, allow_foreign: bool) -> str | None:
    host, sep, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"session {session[:80]!r} is not host:port"
    if not allow_foreign and host != peer_host:
        return f"session host {host[:80]!r} is not the registering peer's address {peer_host!r}"
    return None


def dst_pages_problem(dst: list[int], num_pages: int, prompt_len: int, page_size: int,
                      max_room_pages: int) -> str | None:
    need = -(-prompt_len // page_size)
    if not 0 < len(dst) <= max_room_pages:
        return f"dst_pages has {len(dst)} entries; a room may hold 1..{max_room_pages}"
    if len(dst) < need:
        return f"dst_pages has {len(dst)} pages, the {prompt_len}-token prompt needs {need}"
    pages = np.asarray(dst, dtype=np.int64)
    if pages.min() < 0 or pages.max() >= num_pages:
        return f"dst_pages must lie in [0, {num_pages}) (decode's pool), got [{pages.min()}, {pages.max()}]"
    if np.unique(pages).size != pages.size:
        return "dst_pages names a decode page twice"
    return None


def register_problem(msg: dict, local: PoolLayout, peer_host: str, *, allow_foreign_session: bool = False,
                     max_room_pages: int = DEFAULT_MAX_ROOM_PAGES) -> str | None:
    """Why a REGISTER frame (already schema-checked) cannot be accepted, or ``None``."""
    reason = local.mismatch(remote_layout(msg))
    if reason is not None:
        return reason
    if msg["aux_bytes"] < AUX_BYTES or msg["aux_ptr"] == 0:
        return f"aux buffer of {msg['aux_bytes']} bytes at {msg['aux_ptr']:#x} cannot hold the {AUX_BYTES}-byte record"
    reason = session_problem(msg["session"], peer_host, allow_foreign_session)
    if reason is not None:
        return reason
    if msg["num_pages"] < 1:
        return "decode's pool has no pages (num_pages = 0)"
    extents = [(p, msg["mla_page_bytes"]) for p in msg["mla_ptrs"]] + \
              [(p, msg["index_page_bytes"]) for p in msg["index_ptrs"]]
    if any(p + msg["num_pages"] * nbytes >= _ADDRESS_LIMIT for p, nbytes in extents) \
            or msg["aux_ptr"] + msg["aux_bytes"] >= _ADDRESS_LIMIT:
        return "a registered buffer would end past the 63-bit address space"
    return dst_pages_problem(msg["dst_pages"], msg["num_pages"], msg["prompt_len"], msg["page_size"], max_room_pages)

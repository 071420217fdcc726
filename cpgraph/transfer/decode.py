"""Decode side: a non-CP paged pool that receives the prefill's KV, then a 1-token extend.

Decode allocates its own pages per room (``ceil((prompt_len + 1) /
page_size)``, one slot for the token it will generate), registers the
pool's base addresses with every prefill CP rank, polls them (status =
minimum over ranks), and on abort sends ABORT to every rank and frees the
pages only after every ACK -- pages of an un-ACKed room stay quarantined,
because a late write could still land in them.

Each room gets a fresh 128-bit secret (``secrets.token_hex``) sent with
REGISTER; only a client presenting it may POLL or ABORT the room on a
prefill rank (``docs/security.md``).  If any rank refuses a registration,
the ranks that already accepted it are sent ABORT before the pages are
freed (or quarantined, without every ACK).  A reply that is not the
expected frame for the room -- wrong type, wrong room, a status outside
:class:`RoomStatus` -- counts as Failed, never as an exception.

:func:`decode_meta` builds the :class:`BatchMeta` of one decode step: one
row per request at position ``L`` (its prompt length) over a full view of
its ``L`` cached rows plus the new row.  The planner cannot express this
(cached prefixes are page aligned there, a decode position usually is not),
so the few fields are written directly; for page-aligned ``L`` they equal
what ``build_batch`` produces (tested).
"""

from __future__ import annotations

import secrets
import time
from typing import Sequence

import numpy as np
import torch

from cpgraph.models.batch import BatchMeta
from cpgraph.runtime.kv_pool import KVPool

from .control import request
from .engine import MooncakeEngine
from .frames import FrameError
from .layout import PoolLayout
from .sender import AUX_BYTES
from .status import RoomStatus, StatusTable, agree


_STATUS_VALUES = frozenset(int(s) for s in RoomStatus)


class TransferRefused(RuntimeError):
    """A prefill rank refused the pairing (fingerprint mismatch, ...)."""


class DecodeSide:
    def __init__(self, pool: KVPool, *, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 max_rooms: int = 64, timeout: float = 5.0, strict_bind: bool = False):
        self.pool, self.timeout = pool, timeout
        self.engine = MooncakeEngine(host, protocol, device_name, strict_bind=strict_bind)
        for t in pool.mla + list(pool.index_k.values()):
            self.engine.register(t)
        self.aux = torch.zeros(max_rooms, AUX_BYTES // 8, dtype=torch.int64)
        self.engine.register(self.aux)
        self.layout = PoolLayout.of(pool)
        self.statuses = StatusTable()
        self.rooms: dict[int, dict] = {}
        self.quarantined: list[int] = []

    def open_room(self, room: int, prompt_len: int, peers: Sequence[str]) -> list[int]:
        """Allocate pages, register them with every prefill peer; returns the room's page table."""
        if not 0 <= room < self.aux.shape[0]:
            raise ValueError(f"room must be in [0, {self.aux.shape[0]}), got {room}")
        if room in self.rooms:
            raise ValueError(f"room {room} is already open on this decode")
        ps = self.pool.config.page_size
        table = self.pool.alloc_pages_with_owners([0] * ((prompt_len + 1 + ps - 1) // ps))
        secret = secrets.token_hex(16)
        self.rooms[room] = {"table": table, "peers": [], "len": prompt_len, "secret": secret}
        lay = self.layout
        msg = {"type": "REGISTER", "room": room, "secret": secret, "session": self.engine.session_id,
               "fingerprint": lay.fingerprint, "page_size": lay.page_size, "mla_ptrs": list(lay.mla_ptrs),
               "mla_page_bytes": lay.mla_page_bytes, "index_layers": list(lay.index_layers),
               "index_ptrs": list(lay.index_ptrs), "index_page_bytes": lay.index_page_bytes,
               "num_pages": self.pool.config.num_pages, "prompt_len": prompt_len, "dst_pages": table,
               "aux_ptr": self.aux[room].data_ptr(), "aux_bytes": AUX_BYTES}
        for peer in peers:
            # Listed before the request: a peer whose reply is lost may still have accepted the room.
            self.rooms[room]["peers"].append(peer)
            try:
                reply = request(peer, msg, self.timeout)
            except (OSError, FrameError) as exc:
                self.abort(room)
                raise TransferRefused(f"prefill {peer} did not answer REGISTER of room {room}: {exc}") from None
            if reply.get("type") == "REGISTER_OK" and reply.get("room") == room:
                continue
            self.rooms[room]["peers"].pop()  # it refused: nothing of this room is registered there
            self.abort(room)
            if reply.get("type") == "REFUSED":
                raise TransferRefused(f"prefill rank {reply['rank']} refused room {room}: {reply['reason']}")
            raise TransferRefused(f"unexpected reply {reply.get('type')} to REGISTER of room {room}")
        self.statuses.update(room, RoomStatus.WAITING)
        return table

    def _ask(self, peer: str, kind: str, room: int) -> dict | None:
        """One POLL/ABORT with the room's secret; ``None`` on any transport or frame error."""
        try:
            reply = request(peer, {"type": kind, "room": room, "secret": self.rooms[room]["secret"]}, self.timeout)
        except (OSError, FrameError):
            return None
        return reply if reply.get("room") == room else None

    def poll(self, room: int) -> RoomStatus:
        """Minimum status over the prefill peers; an unreachable or refusing peer counts as Failed."""
        if room not in self.rooms:
            return self.statuses.get(room) if room in self.statuses else RoomStatus.FAILED
        seen = []
        for peer in self.rooms[room]["peers"]:
            reply = self._ask(peer, "POLL", room)
            ok = reply is not None and reply.get("type") == "STATUS" and reply["status"] in _STATUS_VALUES
            seen.append(reply["status"] if ok else RoomStatus.FAILED)
        return self.statuses.update(room, agree(seen))

    def wait(self, room: int, timeout: float) -> RoomStatus:
        """Poll until Success or Failed; Failed after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.poll(room)
            if st in (RoomStatus.SUCCESS, RoomStatus.FAILED):
                return st
            if time.monotonic() >= deadline:
                self.statuses.fail(room)
                return RoomStatus.FAILED
            time.sleep(0.005)

    def abort(self, room: int) -> bool:
        """ABORT every peer; free the pages only if every peer ACKed (else quarantine them)."""
        self.statuses.fail(room)
        if room not in self.rooms:
            return True
        acked = True
        for peer in self.rooms[room]["peers"]:
            reply = self._ask(peer, "ABORT", room)
            acked &= reply is not None and reply.get("type") == "ABORT_ACK"
        if acked:
            self._free(room)
        else:
            self.quarantined.extend(self.rooms.pop(room)["table"])
        return acked

    def first_token(self, room: int) -> int:
        return int(self.aux[room, 0])

    def draft_token(self, room: int) -> int | None:
        """The prefill's MTP draft guess after the first token (what a first speculative step verifies), or
        ``None`` when the prefill ran no draft."""
        tok = int(self.aux[room, 3])
        return None if tok < 0 else tok

    def _free(self, room: int) -> None:
        info = self.rooms.pop(room, None)
        if info is not None:
            self.pool.free(info["table"])

    def release(self, room: int) -> None:
        self._free(room)

    def close(self) -> None:
        self.engine.close()


def decode_meta(seq_lens: Sequence[int], tables: Sequence[Sequence[int]], page_size: int, device=None) -> BatchMeta:
    """BatchMeta of one decode step: request i's new token at position ``seq_lens[i]`` over its cached rows."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    B = lens.shape[0]
    prefix_slots, kv_start = [], np.zeros(B, dtype=np.int64)
    for i, (n, table) in enumerate(zip(lens.tolist(), tables)):
        table = np.asarray(table, dtype=np.int64)
        pos = np.arange(n + 1, dtype=np.int64)
        if table.shape[0] * page_size <= n or (table[pos // page_size] < 0).any():
            raise ValueError(f"request {i}: page table does not cover position {n}")
        prefix_slots.append(table[pos // page_size] * page_size + pos % page_size)
        if i + 1 < B:
            kv_start[i + 1] = kv_start[i] + n + 1
    P = int(lens.sum())
    row_slots = np.array([s[-1] for s in prefix_slots], dtype=np.int64)
    cached = np.concatenate([s[:-1] for s in prefix_slots])
    # Full view of request i: its L cached rows (gathered rows) then its new row (compute row P + i).
    kv_source = np.concatenate([np.append(np.arange(a, a + n), P + i)
                                for i, (a, n) in enumerate(zip(np.cumsum(np.append(0, lens[:-1])).tolist(), lens.tolist()))])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    meta = BatchMeta(positions=t(lens), ks=t(kv_start), ke=t(kv_start + lens + 1), row_slots=t(row_slots),
                     prefix_slots=t(cached), kv_source=t(kv_source), last_token_index=t(np.arange(B)),
                     rerange_index=t(np.arange(B)))
    return meta.to(device) if device is not None else meta


@torch.no_grad()
def decode_step(model, layout, pool: KVPool, tokens: Sequence[int], seq_lens: Sequence[int],
                tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """fp32 logits ``[B, vocab]`` of the token after ``tokens`` (one per request), over the received cache."""
    meta = decode_meta(seq_lens, tables, pool.config.page_size, model.device)
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=model.device)
    index = [pool.index_pool(i) for i in model.config.indexer_layers]
    # A pool that also holds the MTP draft layer keeps it after the target's layers.
    return model(ids, meta, pool.mla[: model.config.num_hidden_layers], index, layout).logits

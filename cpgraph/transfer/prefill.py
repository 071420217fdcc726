"""One prefill CP rank's transfer side: engine, control server, sender, per-layer manager.

The driver calls, per room and chunk::

    chunk = peer.begin_chunk(room, table, page_start, page_end, last, overlap=True)
    ... forward (hooks fire on_layer_end) ...
    peer.end_chunk(chunk, first_token=...)   # waits exactly what was enqueued, sends the rest, aux on the last

and ``peer.release(room)`` before freeing the room's pages: it drains every
in-flight batch of the room first.  An ABORT from decode fails the room
(no later chunk or layer is written) and drains before the ACK is sent.

Rooms belong to the decode that registered them first (``docs/security.md``):
the REGISTER carries a random per-room secret chosen by decode; POLL and
ABORT must present it.  A second REGISTER for a room is refused unless it is
an identical resend (same secret, same parameters), which is answered
REGISTER_OK again so a decode may resend after a lost reply.  Destination
pages are checked at registration (``rooms.py``), and a chunk that still
does not fit fails only its own room.  The peer tracks at most ``max_rooms``
rooms: finished rooms (Success/Failed) and rooms registered but not started
within ``room_ttl`` seconds are evicted oldest first to make space; past
that a REGISTER is refused.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from cpgraph.runtime.kv_pool import KVPool

from .control import DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_CONNECTIONS, ControlServer
from .engine import MooncakeEngine
from .frames import FrameError
from .layout import PoolLayout
from .overlap import LayerContext, LayerTransferManager
from .rooms import DEFAULT_MAX_ROOM_PAGES, DEFAULT_MAX_ROOMS, register_problem, remote_layout
from .sender import AUX_BYTES, ChunkPlan, KVSender, RoomTarget
from .status import RoomStatus, StatusTable

log = logging.getLogger("cpgraph.transfer")


@dataclass
class ChunkSend:
    plan: ChunkPlan | None  # None: the chunk could not be planned and its room was failed
    ctx: LayerContext | None
    t_begin: float
    room: int = -1


class PrefillPeer:
    def __init__(self, pool: KVPool, rank: int = 0, *, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", max_batch_bytes: int = 32 << 20, group: int = 1, workers: int = 2,
                 timeout: float = 30.0, hooked_layers: int | None = None, event_factory=None,
                 max_rooms: int = DEFAULT_MAX_ROOMS, max_room_pages: int = DEFAULT_MAX_ROOM_PAGES,
                 room_ttl: float = 600.0, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 frame_timeout: float = DEFAULT_FRAME_TIMEOUT, allow_foreign_session: bool = False,
                 strict_bind: bool = False):
        if max_rooms < 1 or max_room_pages < 1 or room_ttl <= 0:
            raise ValueError(f"PrefillPeer: max_rooms, max_room_pages must be >= 1 and room_ttl > 0, "
                             f"got {max_rooms}, {max_room_pages}, {room_ttl}")
        self.pool, self.rank, self.timeout = pool, rank, timeout
        self.max_rooms, self.max_room_pages, self.room_ttl = max_rooms, max_room_pages, room_ttl
        self.allow_foreign_session = allow_foreign_session
        self.engine = MooncakeEngine(host, protocol, device_name, strict_bind=strict_bind)
        for t in pool.mla + list(pool.index_k.values()):
            self.engine.register(t)
        self._aux = torch.zeros(AUX_BYTES // 8, dtype=torch.int64)
        self.engine.register(self._aux)
        self.layout = PoolLayout.of(pool)
        self.statuses = StatusTable()
        self.sender = KVSender(self.engine, self.layout, self.statuses, max_batch_bytes)
        self.manager = LayerTransferManager(hooked_layers or pool.config.num_layers, group, workers, timeout,
                                            event_factory)
        self.targets: dict[int, RoomTarget] = {}  # rooms this rank may still send
        self._secrets: dict[int, str] = {}  # every registered room until evicted (POLL/ABORT check it)
        self._registered_at: dict[int, float] = {}
        self._open: dict[int, list[LayerContext]] = {}
        self._cond = threading.Condition()
        self.refused_registers = 0
        self.refused_requests = 0  # POLL/ABORT without the room's secret
        self.layers_per_layer = 0  # layers a forward hook enqueued (sent while the forward ran)
        self.layers_after_forward = 0  # layers end_chunk had to send after the forward
        self.control = ControlServer(self._handle, host, timeout=frame_timeout, max_connections=max_connections)
        self.address = self.control.address

    # control ------------------------------------------------------------------------
    def _refuse(self, room: int, reason: str) -> dict:
        return {"type": "REFUSED", "room": room, "rank": self.rank, "reason": reason[:1000]}

    def _handle(self, msg: dict, peer_host: str = "127.0.0.1") -> dict:
        room = msg["room"]
        kind = msg["type"]
        if kind == "REGISTER":
            return self._register(msg, peer_host)
        if kind not in ("POLL", "ABORT"):
            raise FrameError(f"prefill does not accept {kind} frames")
        with self._cond:
            secret = self._secrets.get(room)
            if secret is None or not hmac.compare_digest(secret, msg["secret"]):
                self.refused_requests += 1
                why = "is not registered here" if secret is None else "belongs to another decode (wrong secret)"
                return self._refuse(room, f"room {room} {why}")
        if kind == "POLL":
            return {"type": "STATUS", "room": room, "rank": self.rank, "status": int(self.statuses.get(room)),
                    "bytes_sent": self.sender.bytes_sent(room)}
        self.abort(room)
        return {"type": "ABORT_ACK", "room": room, "rank": self.rank}

    def _register(self, msg: dict, peer_host: str) -> dict:
        room = msg["room"]
        reason = register_problem(msg, self.layout, peer_host, allow_foreign_session=self.allow_foreign_session,
                                  max_room_pages=self.max_room_pages)
        params = {k: v for k, v in msg.items() if k != "dst_pages"}
        with self._cond:
            if reason is None and (room in self._secrets or room in self.statuses):
                current = self.targets.get(room)
                if current is not None and current.request == params and not self.statuses.failed(room) \
                        and np.array_equal(current.dst_pages, msg["dst_pages"]):
                    return {"type": "REGISTER_OK", "room": room, "rank": self.rank}  # identical resend
                reason = (f"room {room} already failed" if self.statuses.failed(room) else
                          f"room {room} is already registered by another decode" if room in self._secrets else
                          f"room {room} is already known to this rank")
            if reason is None and not self._make_space():
                reason = f"{self.max_rooms} rooms are in flight on this rank (max_rooms); retry later"
            if reason is not None:
                self.refused_registers += 1
                log.info("prefill rank %d: REGISTER of room %d from %s refused: %s", self.rank, room, peer_host, reason)
                return self._refuse(room, reason)
            self.targets[room] = RoomTarget(room, msg["session"], remote_layout(msg),
                                            np.asarray(msg["dst_pages"], dtype=np.int64), msg["aux_ptr"],
                                            msg["aux_bytes"], secret=msg["secret"], request=params)
            self._secrets[room] = msg["secret"]
            self._registered_at[room] = time.monotonic()
            self.statuses.update(room, RoomStatus.WAITING)
            self._cond.notify_all()
        return {"type": "REGISTER_OK", "room": room, "rank": self.rank}

    def _make_space(self) -> bool:
        """With ``_cond`` held: evict finished (then stale unstarted) rooms until one more fits."""
        if len(self.statuses) < self.max_rooms:
            return True
        now = time.monotonic()
        stale = [r for r, t in self._registered_at.items()
                 if now - t > self.room_ttl and self.statuses.get(r) == RoomStatus.WAITING]
        for r in self.statuses.finished() + stale:
            if r in self._open:
                continue
            self._forget(r)
            if len(self.statuses) < self.max_rooms:
                return True
        return False

    def _forget(self, room: int) -> None:
        self.targets.pop(room, None)
        self._secrets.pop(room, None)
        self._registered_at.pop(room, None)
        self.statuses.forget(room)
        self.sender.forget(room)

    def wait_registered(self, room: int, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while room not in self.targets and not self.statuses.failed(room):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._make_space()  # a local failure record; evict what is finished first
                    self.statuses.fail(room)
                    return False
                self._cond.wait(min(left, 0.1))
        return room in self.targets and not self.statuses.failed(room)

    # sending --------------------------------------------------------------------------
    def begin_chunk(self, room: int, table, page_start: int, page_end: int, last: bool,
                    overlap: bool = True) -> ChunkSend:
        """Plan one chunk; a chunk decode's registration cannot hold fails its room only (logged)."""
        with self._cond:
            target = self.targets.get(room)
            if target is None:
                raise ValueError(f"room {room} has no registered decode target")
            self.statuses.update(room, RoomStatus.TRANSFERRING)  # under the lock: no eviction races a start
        try:
            plan = self.sender.plan(target, table, page_start, page_end, last)
        except ValueError as exc:
            log.warning("prefill rank %d: room %d failed: %s", self.rank, room, exc)
            self.statuses.fail(room)
            return ChunkSend(None, None, time.perf_counter(), room)
        ctx = None
        if overlap:
            s = self.sender
            ctx = LayerContext((room, page_start), range(self.pool.config.num_layers),
                               submit=lambda layers: s.submit_layers(plan, layers),
                               send_sync=lambda layers: s.send_layers(plan, layers),
                               wait=lambda sub, t0: s.wait_submitted(room, sub, t0),
                               is_failed=lambda: self.statuses.failed(room))
            with self._cond:
                self._open.setdefault(room, []).append(ctx)
            self.manager.register(ctx)
        return ChunkSend(plan, ctx, time.perf_counter(), room)

    def end_chunk(self, chunk: ChunkSend, first_token: int | None = None, prompt_len: int = 0,
                  aux_rank: int = 0, draft_token: int | None = None) -> RoomStatus:
        """Finish the chunk; the last one's aux record carries the first token and, when the prefill ran the MTP
        draft, the draft's guess after it (``-1`` without one: docs/transfer.md)."""
        plan = chunk.plan
        if plan is None:
            return self.statuses.get(chunk.room)
        layers = self.pool.config.num_layers
        if chunk.ctx is not None:
            rc = self.manager.finish(chunk.ctx)
            with self._cond:
                open_ctxs = self._open.get(plan.room, [])
                if chunk.ctx in open_ctxs:
                    open_ctxs.remove(chunk.ctx)
                if not open_ctxs:
                    self._open.pop(plan.room, None)
                self.layers_after_forward += len(chunk.ctx.sync_layers)
                self.layers_per_layer += layers - len(chunk.ctx.sync_layers)
        else:
            rc = self.sender.send_layers(plan, range(layers))
            with self._cond:
                self.layers_after_forward += layers
        if rc == 0 and plan.last and self.rank == aux_rank:
            if first_token is None:
                raise ValueError("the last chunk needs first_token for the aux record")
            self._aux.copy_(torch.tensor([first_token, prompt_len, self.rank,
                                          -1 if draft_token is None else draft_token]))
            rc = self.sender.send_aux(plan, self._aux.data_ptr())
        return self.sender.status_after_chunk(plan, rc)

    def abort(self, room: int) -> bool:
        """Fail the room and drain its in-flight per-layer batches; True when drained."""
        self.statuses.fail(room)
        with self._cond:
            ctxs = list(self._open.pop(room, []))
        return all([self.manager.drop(c) for c in ctxs])

    def release(self, room: int) -> bool:
        """Drain the room and stop sending it (Failed unless it succeeded); then its pages may be freed.

        The room's status stays pollable by its decode until evicted (see the module docstring).
        """
        with self._cond:
            ctxs = list(self._open.pop(room, []))
            self.targets.pop(room, None)
            self._registered_at.pop(room, None)
        if self.statuses.get(room) != RoomStatus.SUCCESS:
            self.statuses.fail(room)
        return all([self.manager.drop(c) for c in ctxs])

    def close(self) -> None:
        self.control.close()
        self.manager.close()
        self.engine.close()

"""One prefill CP rank's transfer side: engine, control server, sender, per-layer manager.

The driver calls, per room and chunk::

    chunk = peer.begin_chunk(room, table, page_start, page_end, last, overlap=True)
    ... forward (hooks fire on_layer_end) ...
    peer.end_chunk(chunk, first_token=...)   # waits exactly what was enqueued, sends the rest, aux on the last

and ``peer.release(room)`` before freeing the room's pages: it drains every
in-flight batch of the room first.  An ABORT from decode fails the room
(no later chunk or layer is written) and drains before the ACK is sent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from cpgraph.runtime.kv_pool import KVPool

from .control import ControlServer
from .engine import MooncakeEngine
from .frames import FrameError
from .layout import PoolLayout
from .overlap import LayerContext, LayerTransferManager
from .sender import AUX_BYTES, ChunkPlan, KVSender, RoomTarget
from .status import RoomStatus, StatusTable


@dataclass
class ChunkSend:
    plan: ChunkPlan
    ctx: LayerContext | None
    t_begin: float


class PrefillPeer:
    def __init__(self, pool: KVPool, rank: int = 0, *, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", max_batch_bytes: int = 32 << 20, group: int = 1, workers: int = 2,
                 timeout: float = 30.0, hooked_layers: int | None = None, event_factory=None):
        self.pool, self.rank, self.timeout = pool, rank, timeout
        self.engine = MooncakeEngine(host, protocol, device_name)
        for t in pool.mla + list(pool.index_k.values()):
            self.engine.register(t)
        self._aux = torch.zeros(AUX_BYTES // 8, dtype=torch.int64)
        self.engine.register(self._aux)
        self.layout = PoolLayout.of(pool)
        self.statuses = StatusTable()
        self.sender = KVSender(self.engine, self.layout, self.statuses, max_batch_bytes)
        self.manager = LayerTransferManager(hooked_layers or pool.config.num_layers, group, workers, timeout,
                                            event_factory)
        self.targets: dict[int, RoomTarget] = {}
        self._open: dict[int, list[LayerContext]] = {}
        self._cond = threading.Condition()
        self.control = ControlServer(self._handle, host)
        self.address = self.control.address

    # control ------------------------------------------------------------------------
    def _handle(self, msg: dict) -> dict:
        room = msg["room"]
        kind = msg["type"]
        if kind == "REGISTER":
            return self._register(msg)
        if kind == "POLL":
            return {"type": "STATUS", "room": room, "rank": self.rank, "status": int(self.statuses.get(room)),
                    "bytes_sent": self.sender.metric(room).bytes_sent}
        if kind == "ABORT":
            self.abort(room)
            return {"type": "ABORT_ACK", "room": room, "rank": self.rank}
        raise FrameError(f"prefill does not accept {kind} frames")

    def _register(self, msg: dict) -> dict:
        room = msg["room"]
        remote = PoolLayout(msg["fingerprint"], msg["page_size"], tuple(msg["mla_ptrs"]), msg["mla_page_bytes"],
                            tuple(msg["index_layers"]), tuple(msg["index_ptrs"]), msg["index_page_bytes"])
        reason = self.layout.mismatch(remote)
        if reason is None and msg["aux_bytes"] < AUX_BYTES:
            reason = f"aux buffer of {msg['aux_bytes']} bytes is smaller than the {AUX_BYTES}-byte record"
        if reason is None and self.statuses.failed(room):
            reason = f"room {room} already failed"
        if reason is not None:
            return {"type": "REFUSED", "room": room, "rank": self.rank, "reason": reason}
        with self._cond:
            self.targets[room] = RoomTarget(room, msg["session"], remote, np.asarray(msg["dst_pages"], dtype=np.int64),
                                            msg["aux_ptr"], msg["aux_bytes"])
            self.statuses.update(room, RoomStatus.WAITING)
            self._cond.notify_all()
        return {"type": "REGISTER_OK", "room": room, "rank": self.rank}

    def wait_registered(self, room: int, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while room not in self.targets and not self.statuses.failed(room):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.statuses.fail(room)
                    return False
                self._cond.wait(min(left, 0.1))
        return room in self.targets and not self.statuses.failed(room)

    # sending --------------------------------------------------------------------------
    def begin_chunk(self, room: int, table, page_start: int, page_end: int, last: bool,
                    overlap: bool = True) -> ChunkSend:
        target = self.targets.get(room)
        if target is None:
            raise ValueError(f"room {room} has no registered decode target")
        plan = self.sender.plan(target, table, page_start, page_end, last)
        self.statuses.update(room, RoomStatus.TRANSFERRING)
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
        return ChunkSend(plan, ctx, time.perf_counter())

    def end_chunk(self, chunk: ChunkSend, first_token: int | None = None, prompt_len: int = 0,
                  aux_rank: int = 0) -> RoomStatus:
        plan = chunk.plan
        if chunk.ctx is not None:
            rc = self.manager.finish(chunk.ctx)
            with self._cond:
                open_ctxs = self._open.get(plan.room, [])
                if chunk.ctx in open_ctxs:
                    open_ctxs.remove(chunk.ctx)
        else:
            rc = self.sender.send_layers(plan, range(self.pool.config.num_layers))
        if rc == 0 and plan.last and self.rank == aux_rank:
            if first_token is None:
                raise ValueError("the last chunk needs first_token for the aux record")
            self._aux.copy_(torch.tensor([first_token, prompt_len, self.rank, 0]))
            rc = self.sender.send_aux(plan, self._aux.data_ptr())
        return self.sender.status_after_chunk(plan, rc)

    def abort(self, room: int) -> bool:
        """Fail the room and drain its in-flight per-layer batches; True when drained."""
        self.statuses.fail(room)
        with self._cond:
            ctxs = list(self._open.pop(room, []))
        return all([self.manager.drop(c) for c in ctxs])

    def release(self, room: int) -> bool:
        """Drain the room (abort semantics if it is not finished); afterwards its pages may be freed."""
        with self._cond:
            ctxs = list(self._open.pop(room, []))
            self.targets.pop(room, None)
        return all([self.manager.drop(c) for c in ctxs])

    def close(self) -> None:
        self.control.close()
        self.manager.close()
        self.engine.close()

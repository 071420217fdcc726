"""The engine's KV sink over Mooncake: a :class:`~cpgraph.transfer.prefill.PrefillPeer` per CP rank.

Why an adapter: the engine lives in ``cpgraph.runtime``, below
``cpgraph.transfer`` in the import order, so it talks to a small sink
interface (see :mod:`cpgraph.runtime.prefill_engine`); this class maps it
onto the decode-registered room protocol of :mod:`cpgraph.transfer.prefill`
(REGISTER with a per-room secret, POLL, ABORT/ACK), each rank its own pages.

Two ways a chunk goes out.  ``send_chunk`` after the step that computed it
(every layer after the forward).  Or, once :meth:`RoomSender.attach` has
installed the per-layer hooks on the model (``cpgraph.transfer.overlap``),
``begin_chunk`` before the step's forward and ``end_chunk`` after it: each
layer's pages are sent while the later layers compute, and ``end_chunk``
waits only for the tail (and sends any layer no hook saw).  A forward
replayed from a CUDA graph runs no Python per layer, so ``cpgraph serve``
attaches the hooks only without ``--cuda-graphs``.
"""

from __future__ import annotations

from cpgraph.transfer.prefill import PrefillPeer
from cpgraph.transfer.status import RoomStatus


class RoomSender:
    """``registered / send_chunk / bytes_sent / finish / abort`` over one rank's :class:`PrefillPeer`.

    ``register_wait``: seconds a rank other than the leader waits for a room
    its decode is still registering (the leader checked its own at submit).
    """

    def __init__(self, peer: PrefillPeer, register_wait: float = 5.0):
        self.peer, self.register_wait = peer, register_wait
        self._hooks: list = []

    @property
    def overlap(self) -> bool:
        """Whether chunks go out layer by layer during the forward (:meth:`attach` ran)."""
        return bool(self._hooks)

    def attach(self, model) -> None:
        """Hook ``model``'s per-layer KV events (the model whose forward writes this peer's pool), so chunks begun
        with :meth:`begin_chunk` send each layer as soon as it is written."""
        from cpgraph.transfer.overlap import attach_layer_hooks

        if not self._hooks:
            self._hooks = attach_layer_hooks(model, self.peer.manager, self.peer.pool)

    @property
    def address(self) -> str:
        return self.peer.address

    def registered(self, room: int) -> bool:
        """Is ``room`` registered here and not failed?  Non-blocking, no side effect (called on submit)."""
        return room in self.peer.targets and not self.peer.statuses.failed(room)

    def send_chunk(self, room: int, table, page_start: int, page_end: int, last: bool, first_token: int | None,
                   prompt_len: int, draft_token: int | None = None) -> bool:
        """Send pages ``[page_start, page_end)`` of ``table`` now (after the forward); False when the room failed."""
        return self.end_chunk(self._begin(room, table, page_start, page_end, last, overlap=False), last, first_token,
                              prompt_len, draft_token)

    def begin_chunk(self, room: int, table, page_start: int, page_end: int, last: bool):
        """Before the forward that computes the chunk: open it, so its layers go out as the forward writes them."""
        return self._begin(room, table, page_start, page_end, last, overlap=self.overlap)

    def end_chunk(self, chunk, last: bool, first_token: int | None, prompt_len: int,
                  draft_token: int | None = None) -> bool:
        """After that forward: wait for the chunk's layers (sending any no hook saw); False when the room failed.
        ``draft_token``: the MTP draft's guess after the first token, into the last chunk's aux record."""
        if chunk is None:
            return False
        status = self.peer.end_chunk(chunk, first_token=first_token, prompt_len=prompt_len, draft_token=draft_token)
        return status == RoomStatus.SUCCESS if last else status != RoomStatus.FAILED

    def _begin(self, room: int, table, page_start: int, page_end: int, last: bool, overlap: bool):
        if not self.peer.wait_registered(room, self.register_wait):
            return None  # never write into pages decode may have reused
        return self.peer.begin_chunk(room, [int(p) for p in table], page_start, page_end, last, overlap=overlap)

    def bytes_sent(self, room: int) -> int:
        return self.peer.sender.bytes_sent(room)

    def finish(self, room: int) -> None:
        self.peer.release(room)

    def abort(self, room: int) -> None:
        self.peer.abort(room)
        self.peer.release(room)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.peer.close()

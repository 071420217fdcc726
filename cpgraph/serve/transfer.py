"""The engine's KV sink over Mooncake: a :class:`~cpgraph.transfer.prefill.PrefillPeer` per CP rank.

Why an adapter: the engine lives in ``cpgraph.runtime``, below
``cpgraph.transfer`` in the import order, so it talks to a small sink
interface (see :mod:`cpgraph.runtime.prefill_engine`); this class maps it
onto the decode-registered room protocol of :mod:`cpgraph.transfer.prefill`
(REGISTER with a per-room secret, POLL, ABORT/ACK).  Chunks are sent after
the step that computed them (``overlap=False``: the serving forward carries
no per-layer hooks), each rank its own pages.
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

    @property
    def address(self) -> str:
        return self.peer.address

    def registered(self, room: int) -> bool:
        """Is ``room`` registered here and not failed?  Non-blocking, no side effect (called on submit)."""
        return room in self.peer.targets and not self.peer.statuses.failed(room)

    def send_chunk(self, room: int, table, page_start: int, page_end: int, last: bool, first_token: int | None,
                   prompt_len: int) -> bool:
        if not self.peer.wait_registered(room, self.register_wait):
            return False  # never write into pages decode may have reused
        chunk = self.peer.begin_chunk(room, [int(p) for p in table], page_start, page_end, last, overlap=False)
        status = self.peer.end_chunk(chunk, first_token=first_token, prompt_len=prompt_len)
        return status == RoomStatus.SUCCESS if last else status != RoomStatus.FAILED

    def bytes_sent(self, room: int) -> int:
        return self.peer.sender.bytes_sent(room)

    def finish(self, room: int) -> None:
        self.peer.release(room)

    def abort(self, room: int) -> None:
        self.peer.abort(room)
        self.peer.release(room)

    def close(self) -> None:
        self.peer.close()

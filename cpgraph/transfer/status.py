"""Per-room transfer status: monotone, Failed wins, ranks agree by minimum.

Why these rules: several threads (the forward's hook workers, the control
server handling an ABORT, the chunk sender) update one room concurrently.
A late "Transferring" must never resurrect a room an ABORT just failed, so
an update only moves a room forward, and FAILED (the smallest value) is
absorbing.  Decode asks every prefill CP rank and takes the *minimum*: the
room is Success only when every rank finished, and Failed as soon as one
rank failed.
"""

from __future__ import annotations

import enum
import threading
from typing import Iterable


class RoomStatus(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1  # room known, decode not registered yet
    WAITING = 2  # decode registered its buffers, nothing sent yet
    TRANSFERRING = 3
    SUCCESS = 4


def agree(statuses: Iterable[int]) -> RoomStatus:
    """The room's status as seen across ranks: the minimum (Failed if any failed; empty -> Failed)."""
    values = [int(s) for s in statuses]
    return RoomStatus(min(values)) if values else RoomStatus.FAILED


class StatusTable:
    """Thread-safe room -> status map with monotone updates (Failed is absorbing)."""

    def __init__(self):
        self._status: dict[int, RoomStatus] = {}
        self._lock = threading.Lock()

    def get(self, room: int) -> RoomStatus:
        with self._lock:
            return self._status.get(room, RoomStatus.BOOTSTRAPPING)

    def __contains__(self, room: int) -> bool:
        with self._lock:
            return room in self._status

    def __len__(self) -> int:
        with self._lock:
            return len(self._status)

    def forget(self, room: int) -> None:
        """Drop the room's entry (the owner bounds the table; see ``PrefillPeer``)."""
        with self._lock:
            self._status.pop(room, None)

    def finished(self) -> list[int]:
        """Rooms in Success or Failed, oldest entry first (eviction candidates)."""
        with self._lock:
            return [r for r, s in self._status.items() if s in (RoomStatus.SUCCESS, RoomStatus.FAILED)]

    def update(self, room: int, status: int) -> RoomStatus:
        """Move ``room`` to ``status`` unless that goes backwards; returns the resulting status."""
        new = RoomStatus(status)
        with self._lock:
            cur = self._status.get(room)
            if cur is None or (cur != RoomStatus.FAILED and (new == RoomStatus.FAILED or new > cur)):
                self._status[room] = cur = new
            return cur

    def fail(self, room: int) -> None:
        self.update(room, RoomStatus.FAILED)

    def failed(self, room: int) -> bool:
        return self.get(room) == RoomStatus.FAILED

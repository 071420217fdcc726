"""The allocation tape the activation model replays: live bytes, booked in the CUDA caching allocator's blocks.

Why its own module: every part of a layer (attention, indexer, MLP, routed
experts) books its tensors on this one tape, and the tests wrap
``_Tape.alloc`` to see each booking as it happens.
"""

from __future__ import annotations

ALLOC_ROUND = 512  # the CUDA caching allocator books every block in multiples of 512 B


def _block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator books for a tensor: rounded up to 512 B (``max_memory_allocated`` counts these)."""
    return 0 if nbytes <= 0 else -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND


class _Tape:
    """Live bytes over one stretch of the forward, replayed allocation by allocation; ``peak`` = most ever live.

    Why a replay and not a sum: eager PyTorch frees a tensor when its last
    reference goes -- a module's locals when its ``forward`` returns, a
    temporary argument when the call returns -- so what is live at the
    peak depends on the order of the forward's statements.  Each phase
    (``attention``, ``indexer``, ``mlp``, ``experts`` beside this module)
    follows its module's code line by line (names are the locals).
    """

    def __init__(self) -> None:
        self.cur = 0
        self.peak = 0
        self._live: dict[str, int] = {}

    def alloc(self, name: str, nbytes: int) -> None:
        b = _block(int(nbytes))
        self._live[name] = self._live.get(name, 0) + b
        self.cur += b
        self.peak = max(self.peak, self.cur)

    def free(self, *names: str) -> None:
        for name in names:
            self.cur -= self._live.pop(name, 0)

    def new_phase(self) -> None:
        """Start measuring a new phase's peak from what is live now (its predecessors' outputs included)."""
        self.peak = self.cur

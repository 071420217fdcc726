"""The engine's record of one request, from submit to its answer.

Why a module of its own: every part of the engine reads and writes it (submit,
admission, the op log, the step, the chunk sends, the result), so it sits
below all of them; it holds data and one derived count, no engine logic.
"""

from __future__ import annotations

import numpy as np

from .cache_engine import PrefixMatch
from .radix import TokenKey
from .requests import RequestHandle
from .sampling import Sampling


class _Live:
    """The engine's record of one admitted-or-waiting request (the same on every rank once admitted)."""

    def __init__(self, rid: int, tokens: list[int], room: int | None, handle: RequestHandle | None, now: float,
                 deadline: float | None, tokens_np: np.ndarray | None = None):
        self.id, self.tokens, self.room, self.handle = rid, tokens, room, handle
        if tokens_np is None:
            self.tokens_np = np.asarray(tokens, dtype=np.int64)
            self.key = TokenKey(self.tokens_np)
        else:  # submit's array, already checked against the vocabulary (< 2**31 ids: PrefillEngine.__init__)
            self.tokens_np, self.key = tokens_np, TokenKey.from_checked(tokens_np)
        self.match: PrefixMatch | None = None
        self.prefix_len = 0  # tokens with KV from the cache (all tiers) at admission
        self.done = 0  # where the next chunk starts: the leading tokens whose KV exists
        self.starts: list[int] = []  # chunk sequence fixed at admission: holes first (docs/cache.md), then the rest
        self.ends: list[int] = []
        self.next_chunk = 0
        self.defers = 0
        self.pages = self.owners = None  # page table of the whole prompt (PrefixMatch.table, chunks filled in)
        self.own_pages: list[np.ndarray] = []
        self.own_owners: list[np.ndarray] = []
        self.reserve: np.ndarray | None = None
        self.cancel_reason: str | None = None
        self.l3_checked = False  # leader: its L3 lookup ran (a prefetch started, or nothing to fetch)
        self.t_submit, self.t_admit, self.deadline = now, None, deadline
        self.transfer_s, self.transfer_ok, self.sent_pages, self.chunks = 0.0, True, 0, 0
        self.forward_s = 0.0  # the forwards of the steps that ran its chunks (whole steps: shared with their batch)
        # With a draft: how the first token is chosen (on every rank: the draft reads it), the chosen token
        # (the radix node's next token when the prompt ends on a page boundary) and the draft's guess after it.
        self.sampling: Sampling | None = None
        self.first_token, self.draft_token = -1, None

    def remaining(self) -> int:
        """Prompt tokens still to compute (the chunks not run yet)."""
        return sum(e - s for s, e in zip(self.starts[self.next_chunk:], self.ends[self.next_chunk:]))


"""Which prompts the engine can take at all: valid token ids, and a length the pool can ever hold.

Why apart from the engine: both are checked at submit, on the caller's
thread, before anything is queued -- a prompt that fails them is refused at
once instead of waiting for pages that can never come -- and both are
functions of the prompt, the vocabulary and the pool's shape alone.
"""

from __future__ import annotations

import numpy as np

from .scheduler import lane_pages


def token_ids(tokens, vocab: int) -> tuple[np.ndarray | None, object]:
    """``(tokens as an int64 array, None)``, or ``(None, the first entry that is not a token id in [0, vocab))``.

    Vectorised (prompts are long); a 1-D integer array -- what the HTTP layer
    hands over after its own checks -- skips the per-element type scan.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            return None, tokens.reshape(-1)[0]
        arr = tokens.astype(np.int64, copy=False)
    else:
        if not set(map(type, tokens)) <= {int, np.int64}:
            return None, next(t for t in tokens if type(t) not in (int, np.int64))
        if max(map(abs, tokens)) >= 2**63:
            return None, next(t for t in tokens if not 0 <= t < vocab)
        arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):  # two reductions; the position only on a refusal
        return None, tokens[int(np.flatnonzero((arr < 0) | (arr >= vocab))[0])]
    return arr, None


def pool_token_limit(num_pages: int, cp_size: int, page_size: int) -> int:
    # The longest prompt whose pages fit on every lane: binary search over lengths (owners are per length).
    lo, hi = 1, num_pages * cp_size * page_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (lane_pages([0], [mid], cp_size, page_size) <= num_pages).all():
            lo = mid
        else:
            hi = mid - 1
    return lo

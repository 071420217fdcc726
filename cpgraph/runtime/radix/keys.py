"""Token keys of the radix tree: O(1) slices over one shared int32 buffer, and the int-array checks.

Why views: a long cached prefix walks a long path and the walk re-slices the
remaining key at every node; a slice that copied would make one match cost
``len x nodes`` (see the package docstring).
"""

from __future__ import annotations

import numpy as np

_TOKEN = np.dtype("<i4")
_TB = _TOKEN.itemsize


def int_array(values, name: str) -> np.ndarray:
    """``values`` as a 1-D int64 array; floats, bools and other non-integers are refused, never truncated."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)



class TokenKey:
    """A token sequence; ``key[a:b]`` is an O(1) view over the same backing buffer."""

    __slots__ = ("_raw", "_arr", "start", "end")

    def __init__(self, tokens, *, _raw: bytes | None = None, _arr=None, start: int = 0, end: int | None = None):
        if _raw is None:
            arr = np.asarray(tokens)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError("TokenKey: tokens must be a 1-D sequence of ints")
            if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(_TOKEN).max):
                raise ValueError("TokenKey: token ids must be in [0, 2**31)")
            _arr = np.ascontiguousarray(arr, dtype=_TOKEN)
            _raw = _arr.tobytes()
        self._raw, self._arr = _raw, _arr
        self.start = start
        self.end = len(_arr) if end is None else end

    @classmethod
    def from_checked(cls, ids: np.ndarray) -> "TokenKey":
        """A key over a 1-D integer array whose ids the caller has already checked to lie in ``[0, 2**31)``.

        Why: the serving engine checks every prompt against the vocabulary at
        submit; scanning it again here (dtype, min, max) is work on every
        request's path for nothing.
        """
        arr = np.ascontiguousarray(ids, dtype=_TOKEN)
        return cls(None, _raw=arr.tobytes(), _arr=arr)

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, s: slice) -> "TokenKey":
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise ValueError("TokenKey supports only contiguous slices")
        a, b, _ = s.indices(len(self))
        b = max(a, b)
        return TokenKey(None, _raw=self._raw, _arr=self._arr, start=self.start + a, end=self.start + b)

    def raw(self) -> bytes:
        """Compact copy of this key (int32 little-endian) -- what a node stores."""
        return self._raw[self.start * _TB : self.end * _TB]

    def tokens(self) -> np.ndarray:
        return self._arr[self.start : self.end]


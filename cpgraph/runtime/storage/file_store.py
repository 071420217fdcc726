"""The embedded default L3: one file per page object in a directory (local disk or a shared file system).

Layout: ``DIR/cpgraph-l3-v1/<key[:2]>/<key>`` (256 fan-out directories).  A
file is the 64-byte object header (:mod:`.object_header`: magic, version,
CRC-32 of the header, length, XXH3-64 of the bytes, key) followed by the
object bytes.

Why each rule:

* **Atomic writes.**  An object is written to a temporary file in the same
  directory and renamed over its final name, so a reader sees either no
  file or a complete one -- never a half-written object.  Several writers of
  the same key (two instances that computed the same prefix) each write
  their own temporary file; the last rename wins and both contents are the
  same page.  A reader that opened the older file keeps reading it.
* **Verified on read.**  The header must carry the magic, the version, the
  key asked for and the length the caller expects; the file must be exactly
  header + length bytes; the XXH3-64 of the bytes read must match.  Anything
  else -- a truncated file, flipped bits, a file copied under another name --
  is a miss: the object is deleted, the failure is logged once per reason,
  and the caller never uses the bytes (it frees the host pages they landed
  in).  The checksum guards against accidental corruption, not against a writer
  who means harm: the directory must be trusted like the model weights are
  (docs/security.md).
* **Size bound, LRU.**  With ``max_bytes`` the store keeps the directory's
  objects under that many bytes: a read hit refreshes the file's mtime
  (when it is more than 10 s old: a hot page is not rewritten per read), and
  when a put takes the total over the bound the least recently used files
  (oldest mtime) are deleted down to 90% of it.  The total is re-measured
  by a directory scan at each eviction, so several processes sharing the
  directory converge on the bound.
* **Failures never stop serving.**  A directory that cannot be created is
  unavailable (every call a miss); one that cannot be written is read-only;
  a full disk (``ENOSPC``/``EDQUOT``) stops writes for ``retry_s`` seconds.
  Each is one warning.

Zero-copy: ``get`` reads with one ``os.preadv`` per object (header, object
and one byte past it, so a wrong length needs no ``fstat`` first) straight
into the caller's host buffers (the L2 rows) and ``put`` writes with
``os.pwritev`` from them; the header is checked and the checksum runs over
the same memory, in place.  Batches run on a small thread pool
(file I/O releases the GIL; the checksum runs at ~25 GB/s per thread).
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from .base import PageStore, Parts, check_parts
from .object_header import HEADER_BYTES, check_header, encode_header, key_bytes
from .object_header import checksum as _checksum
from .object_header import views as _views

SUBDIR = "cpgraph-l3-v1"
# A batch of fewer bytes runs on the calling thread (the hand-off would cost more than it saves).
# Larger batches are cut into one contiguous run of objects per thread: a page of a production-shaped
# layer pair is 180 KB, and a per-object threshold kept such batches on one thread.
PARALLEL_MIN_BYTES = 1 << 20
# Threads per batch by default: one.  Measured with 512 production-shaped page objects (92 MB, page cache
# warm), ``FileStore.get`` took 26-27 ms on 1 thread, 39-42 ms on 4 and 106 ms on 8 on the H200 host
# (gVisor, 16 cores), and 29 / 52 ms on 1 / 4 on the 2-core CI machine: the per-file system calls
# serialise there, and threads add contention.  A store on a local NVMe or a parallel file system
# with cold reads may want ``threads=N`` (docs/cache.md).
DEFAULT_THREADS = 1
# A read hit refreshes the file's mtime (the LRU clock) only when it is older than this: a hot page's
# every read would otherwise be a metadata write.
TOUCH_NS = 10 * 10**9
_FULL = (errno.ENOSPC, errno.EDQUOT)
_TMP_IDS = itertools.count()  # with the pid and thread id: a temporary name no other writer uses
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def parse_size(text) -> int:
    """``"512M"``, ``"2G"``, ``"1.5T"`` or a plain byte count -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"expected a size such as 512M or 2G, got {text!r}") from None
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return int(value * mult)


class FileStore(PageStore):
    """Page objects as files under ``root`` (module docstring): atomic, checksummed, LRU-bounded."""

    def __init__(self, root, *, max_bytes: int | str | None = None, threads: int | None = None,
                 retry_s: float = 60.0):
        super().__init__()
        self.root = Path(root)
        self.name = f"file:{self.root}"
        self.dir = self.root / SUBDIR
        self._dir = str(self.dir)
        self.max_bytes = None if max_bytes is None else parse_size(max_bytes)
        self.retry_s = float(retry_s)
        self._threads = DEFAULT_THREADS if threads is None else max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._available = True
        self._read_only = False
        self._writes_off_until = 0.0
        self._used = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for i in range(256):  # the fan-out directories, once (a put then only creates and renames)
                os.makedirs(os.path.join(self._dir, f"{i:02x}"), exist_ok=True)
        except OSError as exc:
            self._available = False
            self.warn_once("unavailable", f"cannot use directory {self.dir} ({exc.strerror or exc}); "
                                          "every L3 lookup is a miss")
            return
        self._probe_writable()
        if self.max_bytes is not None and self._available:
            self._used = sum(size for _, size, _ in self._scan())

    # ------------------------------------------------------------- state
    def _probe_writable(self) -> None:
        probe = self.dir / f".probe-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            self._read_only = True
            self.warn_once("read_only", f"directory {self.dir} is not writable ({exc.strerror or exc}); "
                                        "pages are read from it but not stored")

    @property
    def available(self) -> bool:
        return self._available

    @property
    def writable(self) -> bool:
        return self._available and not self._read_only and time.monotonic() >= self._writes_off_until

    def path(self, key: str) -> Path:
        return Path(self._path(key))

    def _path(self, key: str) -> str:
        return f"{self._dir}/{key[:2]}/{key}"

    @staticmethod
    def _key_bytes(key: str) -> bytes:
        return key_bytes(key, "FileStore")

    def _map(self, fn, items, sizes):
        items = list(items)
        if len(items) <= 1 or self._threads == 1 or sum(sizes) < PARALLEL_MIN_BYTES:
            return [fn(*it) for it in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="cpgraph-l3-file")
        runs = min(self._threads, len(items))
        bounds = [len(items) * r // runs for r in range(runs + 1)]
        parts = self._pool.map(lambda r: [fn(*it) for it in items[bounds[r]:bounds[r + 1]]], range(runs))
        return [outcome for part in parts for outcome in part]

    # ------------------------------------------------------------- exists
    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.stats["exists_queries"] += len(keys)
        if not self._available:
            return [False] * len(keys)
        return [os.path.isfile(self._path(k)) for k in keys]

    # ---------------------------------------------------------------- get
    def get(self, keys: Sequence[str], parts: Sequence[Parts]) -> list[bool]:
        if len(keys) != len(parts):
            raise ValueError(f"FileStore.get: {len(keys)} key(s) but {len(parts)} part list(s)")
        sizes = [check_parts(p, "FileStore.get", writable=True) for p in parts]
        if not self._available:
            self.stats["get_misses"] += len(keys)
            return [False] * len(keys)
        outcomes = self._map(self._get_one, zip(keys, parts, sizes), sizes)
        for outcome, size in zip(outcomes, sizes):
            if outcome == "hit":
                self.stats["get_pages"] += 1
                self.stats["get_bytes"] += size
            else:
                self.stats["get_misses" if outcome == "miss" else "get_failures"] += 1
        return [o == "hit" for o in outcomes]

    def _get_one(self, key: str, parts: Parts, size: int) -> str:
        """``"hit"``, ``"miss"`` (no such object) or ``"fail"`` (unreadable or failed verification)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "miss"
        except OSError as exc:
            self.warn_once(f"read_{exc.errno}", f"cannot open {path}: {exc.strerror or exc}; treated as a miss")
            return "fail"
        try:
            problem, mtime = self._read_verified(fd, key, parts, size)
            if problem is None and time.time_ns() - mtime > TOUCH_NS:
                try:
                    os.utime(fd)  # LRU: a hit is a use (through the open file: no second path lookup)
                except OSError:
                    pass
        except OSError as exc:
            problem = f"read error {exc.strerror or exc}"
        finally:
            os.close(fd)
        if problem is not None:
            self.warn_once("corrupt", f"object {path} failed verification ({problem}); deleted, never loaded, "
                                      "the page is recomputed")
            try:
                os.unlink(path)
            except OSError:
                pass
            return "fail"
        return "hit"

    def _read_verified(self, fd: int, key: str, parts: Parts, size: int) -> tuple[str | None, int]:
        """``(None, mtime_ns)`` when the object was read into ``parts`` and verified, else ``(what was wrong, 0)``.

        One ``preadv`` reads the header, the object straight into ``parts``
        and one byte more: the file must be exactly header + object, so a
        short count is a truncated file and the extra byte a longer one (no
        ``fstat`` or second read before the bytes land; a failed object's
        bytes in ``parts`` are never used).  Then the header is checked in
        place, and the XXH3-64 of the bytes where they landed.
        """
        head = memoryview(bytearray(HEADER_BYTES + 1))
        views = _views(parts)
        got = os.preadv(fd, [head[:HEADER_BYTES], *views, head[HEADER_BYTES:]], 0)
        want, problem = check_header(head[:HEADER_BYTES], self._key_bytes(key), size)
        if problem is not None:
            return problem, 0
        if got != HEADER_BYTES + size:
            what = f"{got} bytes" if got < HEADER_BYTES + size else "longer"
            return f"file is {what}, header + object are {HEADER_BYTES + size}", 0
        if _checksum(views) != want:
            return "checksum mismatch", 0
        return None, os.fstat(fd).st_mtime_ns

    # ---------------------------------------------------------------- put
    def put(self, keys: Sequence[str], parts: Sequence[Parts]) -> list[bool]:
        if len(keys) != len(parts):
            raise ValueError(f"FileStore.put: {len(keys)} key(s) but {len(parts)} part list(s)")
        sizes = [check_parts(p, "FileStore.put") for p in parts]
        if not self.writable:
            self.stats["put_skipped"] += len(keys)
            return [False] * len(keys)
        outcomes = self._map(self._put_one, zip(keys, parts, sizes), sizes)
        for outcome, size in zip(outcomes, sizes):
            if outcome == "stored":
                self.stats["put_pages"] += 1
                self.stats["put_bytes"] += size
                self._used += HEADER_BYTES + size
            else:
                self.stats["put_skipped" if outcome in ("skipped", "present") else "put_failures"] += 1
        if self.max_bytes is not None and self._used > self.max_bytes:
            self._evict(int(0.9 * self.max_bytes))
        return [o in ("stored", "present") for o in outcomes]

    def _put_one(self, key: str, parts: Parts, size: int) -> str:
        """``"stored"``, ``"present"`` (already stored), ``"skipped"`` (writes off, too large) or ``"failed"``."""
        if not self.writable:  # an earlier page of this batch hit a full disk
            return "skipped"
        if self.max_bytes is not None and HEADER_BYTES + size > self.max_bytes:
            self.warn_once("too_large", f"a {size}-byte page object exceeds the size bound of {self.max_bytes} "
                                        "bytes; not stored")
            return "skipped"
        path = self._path(key)
        if os.path.isfile(path):  # another instance (or an earlier run) stored this page already
            try:
                os.utime(path)
            except OSError:
                pass
            return "present"
        views = _views(parts)
        head = encode_header(self._key_bytes(key), size, _checksum(views))
        tmp = os.path.join(os.path.dirname(path), f".tmp-{key}-{os.getpid()}-{threading.get_ident()}-{next(_TMP_IDS)}")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the fan-out directory was removed behind our back
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                n = os.pwritev(fd, [head, *views], 0)
                if n != HEADER_BYTES + size:
                    raise OSError(errno.ENOSPC, f"short write ({n} of {HEADER_BYTES + size} bytes)")
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._write_failed(exc)
            return "failed"
        return "stored"

    def _write_failed(self, exc: OSError) -> None:
        if exc.errno in _FULL:
            self._writes_off_until = time.monotonic() + self.retry_s
            self.warn_once("full", f"the disk under {self.dir} is full ({exc.strerror or exc}); writes stop for "
                                   f"{self.retry_s:g} s, serving goes on")
        elif exc.errno in _READ_ONLY:
            self._read_only = True
            self.warn_once("read_only", f"directory {self.dir} is not writable ({exc.strerror or exc}); "
                                        "pages are read from it but not stored")
        else:
            self.warn_once(f"write_{exc.errno}", f"writing to {self.dir} failed ({exc.strerror or exc}); "
                                                 "the page is not stored")

    # ----------------------------------------------------------- eviction
    def _scan(self):
        """``(mtime, size, path)`` of every object file (temporary files excluded)."""
        out = []
        try:
            subdirs = list(os.scandir(self.dir))
        except OSError:
            return out
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                for e in os.scandir(sub.path):
                    if e.name.startswith("."):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.append((st.st_mtime_ns, st.st_size, e.path))
            except OSError:
                continue
        return out

    def used_bytes(self) -> int:
        """Bytes of all objects in the directory now (a scan: every writer's objects count)."""
        return sum(size for _, size, _ in self._scan())

    def _evict(self, target: int) -> None:
        files = sorted(self._scan())
        used = sum(size for _, size, _ in files)
        for _, size, path in files:
            if used <= target:
                break
            try:
                os.unlink(path)
            except OSError:
                continue
            used -= size
            self.stats["evicted_pages"] += 1
        self._used = used

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

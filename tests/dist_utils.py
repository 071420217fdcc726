"""Spawned gloo CPU ranks for distributed tests, started once and reused.

Starting a rank costs seconds (a fresh interpreter importing torch), so a
test module should not start ranks per test; ranks are forked from a fork
server that imported torch once.  :class:`DistPool` keeps ``N`` ranks
alive, each in a gloo process group; a test sends it a module-level function
and gets back every rank's return value::

    pool = shared_pool(2)                  # cached per (world size, timeout) for the session
    results = pool.run(check_something, case_args)   # calls check_something(ctx, case_args) on each rank

``pool.submit(...)`` starts the same job and returns at once (``.result()``
waits), so two pools can work at the same time.

Each rank computes with :func:`rank_threads` threads (1 unless the suite
runs under ``CPGRAPH_TEST_THREADS``, see ``tests/conftest.py``).

``ctx`` is a :class:`RankContext` (rank, world_size, group_name).  The
function must be importable by name (defined at module level of a test
module) and return something picklable (plain Python / NumPy preferred).

If any rank raises, :meth:`DistPool.run` raises ``AssertionError`` with every
failing rank's traceback.  A failure or a timeout can leave the other ranks
blocked inside a collective, so the pool is torn down and restarted on the
next ``run``.  The gloo timeout is short so a stuck collective cannot hang
the suite.
"""

from __future__ import annotations

import atexit
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


# Modules the fork server imports once; every rank is then forked from it
# already holding them (importing torch in each of 4 fresh interpreters on 2
# cores costs ~7 s; forking costs milliseconds).  The fork server itself never
# runs torch code, so forking it is safe.  The transformers models (~5 CPU
# seconds to import) and the model and compiler packages serve the ranks of
# the CP model tests, which build a model with a transformers twin.
PRELOAD = [
    "torch", "torch.distributed", "torch.testing", "numpy", "pytest", "hypothesis", "cpgraph.ops", "cpgraph.plan",
    "cpgraph.models", "cpgraph.passes", "cpgraph.runtime.engine",
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "transformers.models.deepseek_v32.modeling_deepseek_v32",
]


# The thread count the suite runs at (tests/conftest.py applies it to the pytest process); docs/bitwise.md.
THREADS_ENV = "CPGRAPH_TEST_THREADS"


def suite_threads() -> int | None:
    """``CPGRAPH_TEST_THREADS`` as a positive int, ``None`` when unset (the machine's default count)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{THREADS_ENV}={raw!r}: expected a positive integer")
    return int(raw)


def rank_threads() -> int:
    """Threads per spawned rank: ``CPGRAPH_TEST_THREADS`` if set, else 1 (ranks share the machine's cores)."""
    return suite_threads() or 1


def _context():
    """Multiprocessing context: ``forkserver`` with :data:`PRELOAD`, else ``spawn``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    return ctx


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    group_name: str


def _worker(rank: int, world_size: int, init_file: str, jobs, results, timeout_s: float, threads: int) -> None:
    # The fork server imported torch before this process existed, so OpenMP has read its environment
    # already: ``torch.set_num_threads`` (OpenMP and MKL) is what sets the rank's thread count.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # daemonic ranks cannot start a compile pool
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    ctx = RankContext(rank, world_size, dist.group.WORLD.group_name)
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            job_id, fn, args, kwargs = job
            try:
                results.put((job_id, rank, True, fn(ctx, *args, **kwargs)))
            except BaseException:  # report everything, the parent decides
                results.put((job_id, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistPool:
    """``world_size`` spawned ranks in one gloo group, reused across jobs."""

    def __init__(self, world_size: int, *, timeout_s: float = 60.0, start_timeout_s: float = 120.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._procs: list = []
        self._job_id = 0

    # -------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        ctx = _context()
        fd, init_file = tempfile.mkstemp(prefix="cpgraph_gloo_")
        os.close(fd)
        os.unlink(init_file)  # FileStore creates it; a stale file would confuse rendezvous
        self._init_file = init_file
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_file, self._jobs[r], self._results, self.timeout_s, rank_threads()),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._first_job = True

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        if not self._procs:
            return
        for q in self._jobs:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._procs = []
        try:
            os.unlink(self._init_file)
        except OSError:
            pass

    # -------------------------------------------------------------------- run
    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Call ``fn(ctx, *args, **kwargs)`` on every rank; return results in rank order."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> "PendingJob":
        """Start ``fn(ctx, *args, **kwargs)`` on every rank and return at once.

        The ranks work while the caller does something else (typically a job
        on another pool: on a 2-core machine two pools of one busy rank each
        finish sooner than one after the other); ``.result()`` waits for the
        ranks and returns or raises exactly like :meth:`run`.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._job_id += 1
        for q in self._jobs:
            q.put((self._job_id, fn, args, kwargs))
        # The first job also waits for the interpreters to start and rendezvous.
        wait = self.timeout_s + (self.start_timeout_s if self._first_job else 0)
        self._first_job = False
        return PendingJob(self, self._job_id, getattr(fn, "__name__", str(fn)), wait)

    def _collect(self, job_id: int, name: str, wait: float) -> list:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world_size:
            try:
                got_id, rank, ok, value = self._results.get(timeout=wait if not errors else 10.0)
            except queue.Empty:
                break
            if got_id != job_id:
                continue  # a straggler from an earlier, failed job
            (out if ok else errors)[rank] = value
        if errors or len(out) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
            self.close()  # ranks may be stuck in a collective: restart next time
            msg = [f"distributed job {name} failed on {self.world_size} ranks"]
            msg += [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                msg.append(f"ranks {missing} did not answer (stuck or dead)")
            raise AssertionError("\n".join(msg))
        return [out[r] for r in range(self.world_size)]


@dataclass
class PendingJob:
    """A job started by :meth:`DistPool.submit`; :meth:`result` waits for every rank's answer."""

    pool: DistPool
    job_id: int
    name: str
    wait_s: float

    def result(self) -> list:
        return self.pool._collect(self.job_id, self.name, self.wait_s)


_POOLS: dict[tuple[int, float], DistPool] = {}


def shared_pool(world_size: int, timeout_s: float = 60.0) -> DistPool:
    """A process-wide pool per ``(world_size, timeout_s)``, shared by every test module of the session.

    Ranks keep what they built between jobs (a compiled model in a module-level
    cache), so modules that ask for the same pool also share those compiles;
    the CP model tests ask for a long timeout (a peer may be compiling while
    this rank waits in a collective) and so get ranks of their own.
    """
    key = (world_size, float(timeout_s))
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = DistPool(world_size, timeout_s=timeout_s)
    return pool


def close_shared_pools(timeout_s: float) -> None:
    """Stop the shared pools made with ``timeout_s`` (their ranks hold compiled models: memory)."""
    for key in [k for k in _POOLS if k[1] == float(timeout_s)]:
        _POOLS.pop(key).close()


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


# ------------------------------------------------------------ test helpers
_COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d_functional::", "gloo:")


def collective_calls(fn: Callable[[], Any]) -> dict[str, int]:
    """Run ``fn()`` under the profiler; count collective calls by name.

    Counts functional collectives (``_c10d_functional::*`` except
    ``wait_tensor``) and backend calls (``gloo:*``), including those issued
    inside custom-op bodies, which a ``TorchDispatchMode`` cannot see.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        name = event.name
        if name.startswith(_COLLECTIVE_PREFIXES) and not name.endswith("wait_tensor"):
            counts[name] = counts.get(name, 0) + 1
    return counts


class fake_group:
    """Context manager: a default process group on the fake backend in *this* process.

    Collectives complete immediately without moving data, which is enough to
    trace and compile ops that take a group name and to check their shapes.
    Yields the group name; destroys the group on exit.
    """

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank

    def __enter__(self) -> str:
        import pytest
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            pytest.skip("a default process group already exists in this process")
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        return dist.group.WORLD.group_name

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

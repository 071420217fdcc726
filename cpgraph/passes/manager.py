"""The pass manager: runs cpgraph's passes as Inductor's post-grad custom pass.

Why post-grad: the graph there is functionalised and decomposed, so a pass
sees every cache write and every collective as an explicit node, and
Inductor still fuses and schedules whatever the passes insert.

A pass is a plain function ``fn(gm, cfg) -> gm`` named as a verb.  The
manager runs them in order, skips those named in ``cfg.disabled_passes``,
records op counts before and after each one (``history``), and, when
``CPGRAPH_DUMP_GRAPHS=<dir>`` is set, writes the graph before and after each
pass there.  Before the passes it checks the row scopes the model states
(``graph_facts.read_row_scopes``): a graph where a pass would have to guess
whether rows are CP-local or global fails there.  Its ``uuid()`` covers the source files of the passes it runs,
the config, the CP size and the group's name, so Inductor's FX-graph cache
never serves a graph compiled under other passes or for another group.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import CPConfig
from .fx_utils import op_counts
from .graph_facts import read_row_scopes

log = logging.getLogger("cpgraph.passes")

PassFn = Callable[[fx.GraphModule, CPConfig], fx.GraphModule]


def _source_files(fns: Sequence[Callable]) -> list[str]:
    files = {Path(__file__).resolve()}
    for fn in fns:
        src = inspect.getsourcefile(fn)
        if src:
            files.add(Path(src).resolve())
    # Helpers every pass uses change behaviour too.
    here = Path(__file__).resolve().parent
    files |= {here / "fx_utils.py", here / "config.py", here / "expert_parallel.py", here / "graph_facts.py"}
    return sorted(str(f) for f in files)


class CPPassManager(CustomGraphPass):
    """Runs ``passes`` (``[(name, fn), ...]``) then any pass it absorbed from the same slot."""

    def __init__(self, cfg: CPConfig, passes: Sequence[tuple[str, PassFn]], absorbed=None):
        names = [n for n, _ in passes]
        unknown = set(cfg.disabled_passes) - set(names)
        if unknown:
            raise ValueError(f"cpgraph: cannot disable unknown pass(es) {sorted(unknown)}; passes are {names}")
        self.cfg = cfg
        self.passes = list(passes)
        self.absorbed = absorbed
        self.history: list[tuple[str, Counter, Counter]] = []
        self.row_scopes: dict[str, str] = {}  # last graph: described node name -> "local" / "global"
        self._dump_seq = 0

    @property
    def enabled(self) -> list[tuple[str, PassFn]]:
        return [(n, fn) for n, fn in self.passes if n not in self.cfg.disabled_passes]

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            raise RuntimeError("cpgraph: the post-grad graph has no owning GraphModule")
        self.run(gm)
        if self.absorbed is not None:
            self.absorbed(gm.graph)

    def run(self, gm: fx.GraphModule) -> fx.GraphModule:
        # Check before any pass: the row scopes the model stated (local / global
        # rows) must cover what the passes decide; they become node metadata.
        self.row_scopes = read_row_scopes(gm, self.cfg.cp_size)
        gm.graph.lint()
        for name, fn in self.enabled:
            before = op_counts(gm.graph)
            self._dump(gm, name, "before")
            out = fn(gm, self.cfg)
            if out is not None:
                gm = out
            gm.graph.lint()
            after = op_counts(gm.graph)
            self.history.append((name, before, after))
            self._dump(gm, name, "after")
            changed = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
            log.debug("cpgraph pass %s: %s", name, changed or "no change")
        gm.recompile()
        return gm

    def _dump(self, gm: fx.GraphModule, name: str, when: str) -> None:
        where = os.environ.get("CPGRAPH_DUMP_GRAPHS")
        if not where:
            return
        d = Path(where)
        d.mkdir(parents=True, exist_ok=True)
        self._dump_seq += 1
        path = d / f"{os.getpid()}_{self._dump_seq:03d}_{name}_{when}.txt"
        path.write_text(gm.print_readable(print_output=False))

    def uuid(self):
        absorbed_id = ""
        if self.absorbed is not None:
            get = getattr(self.absorbed, "uuid", None)
            absorbed_id = get() if callable(get) else None
            if absorbed_id is None:
                log.warning("cpgraph: the absorbed post-grad pass has no uuid(); FX-graph caching is disabled")
                return None
        h = hashlib.sha256()
        for path in _source_files([fn for _, fn in self.enabled]):
            h.update(path.encode())
            h.update(Path(path).read_bytes())
        h.update(json.dumps(self.cfg.cache_key(), sort_keys=True).encode())
        h.update(json.dumps([n for n, _ in self.enabled]).encode())
        h.update(repr(absorbed_id).encode())
        return h.hexdigest()

    def counts_after(self, name: str) -> Counter:
        """Op counts right after the last run of pass ``name`` (for tests and reports)."""
        for n, _, after in reversed(self.history):
            if n == name:
                return after
        raise KeyError(f"pass {name!r} has not run")

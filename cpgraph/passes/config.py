"""``CPConfig``: everything the CP passes depend on, in one place.

The config is part of the pass manager's ``uuid()``, so two compiles that
differ in CP size or pass selection never share an Inductor cache entry.
The rank is deliberately NOT part of it: every rank compiles the same graph
(rank-specific data arrives as input tensors), which is what keeps the
collectives identical on all ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CPConfig:
    """CP settings for the compiler.

    ``group`` is a ``torch.distributed`` process group, a group name, or
    ``None`` for single-device (cp_size 1) compiles.  Passes see only the
    resolved ``group_name`` string and ``cp_size`` int, so fake rules and
    tracing never touch a process group.

    ``index_topk_pattern`` (``"FSFS..."``, one char per layer) applies
    IndexCache at compile time: layers marked ``S`` reuse the previous
    full layer's top-k and lose their indexer compute and index-K stores.
    ``moe_modules`` names the module classes whose region the MoE pass
    compacts (valid rows only before the router).

    ``ep``: expert-parallel degree over the CP group, ``1`` (every rank
    holds every routed expert) or ``cp_size`` (rank ``r`` holds experts
    ``[r*E/ep, (r+1)*E/ep)`` and the expert-parallel pass sends rows to
    their experts' ranks).  ``ep_capacity_slots``: pair slots each row may
    take per destination rank in the dispatch buffers; ``None`` is the
    worst case ``min(top_k, E/ep)``, with which no route can overflow.
    See ``docs/expert_parallel.md``.

    ``fp8_records_in_place``: on one device, let ``read_kv_in_place`` point
    sparse MLA at 656-byte FP8 records in the pool (``sparse_mla_fp8``).  Off
    by default: the layer then keeps its view, unpacked to bf16 at copy rate
    (``mla_fp8_unpack``), and the bf16 attention provider (FlashMLA) reads it.
    Measured at DeepSeek-V3.2's sizes on one H200, 32K tokens, two layers:
    FlashMLA over the unpacked view 57.6 ms of attention against 190 ms for
    the Triton FP8 kernel in place (``benchmarks/production_shape.py
    --variants fp8/fp8``; docs/passes.md).

    ``deterministic``: every row's result depends only on that row's inputs
    and the model, never on the row count, the batch, the cached prefix,
    the chunking or ``cp_size`` -- the products become the row-invariant
    ``cpgraph::invariant_*`` ops (pass ``use_invariant_kernels``), the
    forward runs inside :func:`cpgraph.ops.invariant_mode.deterministic`,
    and Inductor compiles with its numerics-stable settings.  Not with
    ``ep > 1`` (the expert-parallel combine sums a row's slots on another
    path than the single-device experts).  See ``docs/deterministic.md``.
    """

    group: object = None
    cp_size: int = 1
    disabled_passes: tuple[str, ...] = ()
    index_topk_pattern: str | None = None
    moe_modules: tuple[str, ...] = ("MoE",)
    ep: int = 1
    ep_capacity_slots: int | None = None
    fp8_records_in_place: bool = False
    deterministic: bool = False
    group_name: str = field(default="", init=False)

    def __post_init__(self):
        if isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"CPConfig: cp_size must be an int >= 1, got {self.cp_size!r}")
        name = ""
        if isinstance(self.group, str):
            name = self.group
        elif self.group is not None:
            name = getattr(self.group, "group_name", None)
            if not isinstance(name, str):
                raise ValueError(f"CPConfig: group must be a ProcessGroup, a group name or None, got {self.group!r}")
        if self.cp_size > 1 and not name:
            raise ValueError("CPConfig: cp_size > 1 needs a process group (or its name)")
        object.__setattr__(self, "group_name", name)
        # Keep only the name: Inductor deep-copies and pickles its config (this
        # object rides in it), and a ProcessGroup can be neither.
        object.__setattr__(self, "group", name or None)
        pattern = self.index_topk_pattern
        if pattern is not None and (not pattern or set(pattern) - {"F", "S"} or pattern[0] != "F"):
            raise ValueError(
                f"CPConfig: index_topk_pattern must be a string of 'F'/'S' starting with 'F', got {pattern!r}"
            )
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep not in (1, self.cp_size):
            raise ValueError(f"CPConfig: ep must be 1 or cp_size ({self.cp_size}), got {self.ep!r}")
        slots = self.ep_capacity_slots
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise ValueError(f"CPConfig: ep_capacity_slots must be None or an int >= 1, got {slots!r}")
        object.__setattr__(self, "disabled_passes", tuple(sorted(set(self.disabled_passes))))
        if self.ep > 1 and "compact_moe_rows" in self.disabled_passes:
            raise ValueError("CPConfig: ep > 1 needs the compact_moe_rows pass (it sends rows to their experts' ranks)")
        object.__setattr__(self, "moe_modules", tuple(self.moe_modules))
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"CPConfig: deterministic must be a bool, got {self.deterministic!r}")
        if self.deterministic and self.ep > 1:
            raise ValueError("CPConfig: deterministic=True needs ep=1 (the expert-parallel combine is not the "
                             "single-device one; docs/deterministic.md)")

    def cache_key(self) -> dict:
        """The fields that change generated code (for ``uuid()``); no rank, no group object.

        ``group_name`` stays in: the lowered collectives carry the group's name
        as a constant, so two CP groups of one size in one host (data-parallel
        replicas) must not share a cached graph, or one group's ranks would run
        their collectives on the other's process group.
        """
        d = asdict(self)
        d.pop("group")
        return d

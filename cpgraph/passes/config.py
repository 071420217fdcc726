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
    """

    group: object = None
    cp_size: int = 1
    disabled_passes: tuple[str, ...] = ()
    full_hidden_states: bool = False
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
        object.__setattr__(self, "disabled_passes", tuple(sorted(set(self.disabled_passes))))

    def cache_key(self) -> dict:
        """The fields that change generated code (for ``uuid()``); no rank, no group object."""
        d = asdict(self)
        d.pop("group")
        d.pop("group_name")  # the same graph runs on any group of this size
        return d

"""Reading only one expert-parallel rank's routed experts out of a stream of checkpoint tensors.

With ``ep_size > 1`` each rank holds ``E / ep_size`` routed experts
(``docs/expert_parallel.md``); reading the others' and then dropping them
would cost the whole checkpoint in host RAM on every rank.  The same name
patterns also tell the memory check which checkpoint bytes a rank stages
(:func:`.checkpoint_files._staged_bytes`).
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import Tensor

from .config import DSAConfig
from .moe import local_expert_range

_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Any per-expert tensor (weights, and scales of quantised checkpoints) and the stacked expert tensors.
_PER_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_STACKED_EXPERTS_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _expert_range(cfg: DSAConfig, ep_rank: int, ep_size: int) -> tuple[int, int] | None:
    """The routed experts this rank keeps, or ``None`` for all (``ep_size == 1``)."""
    if ep_size == 1 and ep_rank == 0:
        return None
    return local_expert_range(cfg.n_routed_experts, ep_rank, ep_size)


def _local_experts(entries, experts: tuple[int, int]) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs with only the routed experts ``[start, stop)`` read.

    ``entries`` yields ``(name, read)`` where ``read(rows)`` returns the
    tensor (``rows=None``) or its leading-dim slice.  Per-expert tensors of
    other experts are never read; stacked ``[E, ...]`` tensors are read as
    their ``[start, stop)`` rows only; per-expert weights of local experts
    are stacked here, layer by layer, into the layout the sharded model
    holds.  So host memory is bounded by the local share plus one layer's
    stack.  An incomplete local set is passed through under its own names
    for :func:`.loading.load_state` to report.
    """
    start, stop = experts
    parts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, read in entries:
        m = _PER_EXPERT_RE.match(name)
        if m is not None:
            if not start <= int(m.group(1)) < stop:
                continue
            w = _EXPERT_RE.match(name)
            if w is None:
                yield name, read(None)
            else:
                parts.setdefault(w.group(1), {})[(int(w.group(3)), w.group(4))] = read(None)
            continue
        yield name, read(slice(start, stop) if _STACKED_EXPERTS_RE.match(name) else None)
    kinds = ("gate_proj", "up_proj", "down_proj")
    for prefix in list(parts):
        got = parts.pop(prefix)
        complete = len(got) == 3 * (stop - start) and all((j, k) in got for j in range(start, stop) for k in kinds)
        if complete and all(got[(j, "gate_proj")].shape == got[(j, "up_proj")].shape == got[(start, "gate_proj")].shape
                            and got[(j, "down_proj")].shape == got[(start, "down_proj")].shape
                            for j in range(start, stop)):
            yield f"{prefix}.gate_up_proj", torch.stack(
                [torch.cat((got.pop((j, "gate_proj")), got.pop((j, "up_proj"))), 0) for j in range(start, stop)])
            yield f"{prefix}.down_proj", torch.stack([got.pop((j, "down_proj")) for j in range(start, stop)])
        else:
            for (j, k), t in sorted(got.items()):
                yield f"{prefix}.{j}.{k}.weight", t

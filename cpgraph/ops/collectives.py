"""CP collective ops: all-gather rows, rerange to global order, narrow last-token gather.

Why custom ops around collectives: the CP passes must find every
communication step by name (to count them, to move them, to check that each
rank issues the same ones in the same order), and a later lowering pass
replaces each op with its ``*_decomposed`` twin so that Inductor sees the
functional collective (``torch.ops._c10d_functional``) and can overlap it
with compute.  The op body simply runs the decomposition; both give
bit-identical results.

Why the group is passed by *name* with an explicit ``world_size``: fake
rules must be pure shape arithmetic and must never touch a process group.
``group_name`` is what ``ProcessGroup.group_name`` returns (for the default
group ``dist.group.WORLD.group_name``); the real body checks that
``world_size`` matches the group.

Row convention (from the planner): every rank holds ``M`` compute rows; the
rank-major all-gather puts rank ``r``'s local row ``j`` at gathered row
``r * M + j``.  See ``docs/ops/collectives.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor
from .providers import select

_funcol = torch.ops._c10d_functional


# ------------------------------------------------------------------ helpers
def check_group_args(op: str, group_name, world_size) -> None:
    """Metadata-only checks on the group arguments (safe in fake rules)."""
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"cpgraph.{op}: argument 'group_name' must be a non-empty str, got {group_name!r}")
    check_size_arg(op, "world_size", world_size, 1)


def check_size_arg(op: str, name: str, value, minimum: int) -> None:
    """An int argument (or a symbolic one under dynamic compile) that must be ``>= minimum``.

    Symbolic values are not compared: that would add a guard for nothing,
    since their concrete values were checked where they were created.
    """
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"cpgraph.{op}: argument '{name}' must be an int >= {minimum}, got {value!r}")


def resolve_group(op: str, group_name: str, world_size: int):
    """The process group named ``group_name``; its size must equal ``world_size``.

    Real bodies only (fake rules never resolve a group).  A host-side
    registry lookup, no device work and no sync.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except Exception as exc:  # the registry raises various types for unknown names
        msg = f"cpgraph.{op}: argument 'group_name': no process group named {group_name!r} ({exc})"
        raise ValueError(msg) from None
    if group.size() != world_size:
        raise ValueError(
            f"cpgraph.{op}: argument 'world_size' is {world_size} but group {group_name!r} has {group.size()} ranks"
        )
    return group


def _check_rows(op: str, rows) -> None:
    check_tensor(op, "rows", rows)
    if rows.dim() < 1:
        raise ValueError(f"cpgraph.{op}: argument 'rows' must have at least 1 dimension")


def all_gather_dim0(x: Tensor, group_name: str, world_size: int) -> Tensor:
    """Functional rank-major all-gather along dim 0 (``[M, ...] -> [world * M, ...]``)."""
    gathered = _funcol.all_gather_into_tensor(x.contiguous(), world_size, group_name)
    return _funcol.wait_tensor(gathered)


# ------------------------------------------------------- cp_all_gather_rows
def _check_all_gather(rows, group_name, world_size) -> None:
    _check_rows("cp_all_gather_rows", rows)
    check_group_args("cp_all_gather_rows", group_name, world_size)


def cp_all_gather_rows_decomposed(rows: Tensor, group_name: str, world_size: int) -> Tensor:
    """Same result as ``cpgraph::cp_all_gather_rows``, from one functional all-gather."""
    _check_all_gather(rows, group_name, world_size)
    return all_gather_dim0(rows, group_name, world_size)


@torch.library.custom_op("cpgraph::cp_all_gather_rows", mutates_args=())
def cp_all_gather_rows(rows: Tensor, group_name: str, world_size: int) -> Tensor:
    """All-gather every rank's compute rows: ``[M, ...] -> [world_size * M, ...]`` rank-major.

    Row ``r * M + j`` of the result is rank ``r``'s row ``j``; dummy rows
    travel too (uniform shapes are what keep the collective well formed).
    Used where a consumer really needs every row (e.g. a full hidden-states
    output); prefer ``cp_rerange`` / ``cp_last_tokens`` which say why rows move.
    """
    _check_all_gather(rows, group_name, world_size)
    resolve_group("cp_all_gather_rows", group_name, world_size)
    return cp_all_gather_rows_decomposed(rows, group_name, world_size)


@cp_all_gather_rows.register_fake
def _cp_all_gather_rows_fake(rows, group_name, world_size):
    _check_all_gather(rows, group_name, world_size)
    return rows.new_empty((world_size * rows.shape[0], *rows.shape[1:]))


# ---------------------------------------------------------------- cp_rerange
def _check_rerange(rows, rerange_index, group_name, world_size) -> None:
    _check_rows("cp_rerange", rows)
    check_tensor("cp_rerange", "rerange_index", rerange_index, dtype=torch.int64, ndim=1)
    check_same_device("cp_rerange", rows=rows, rerange_index=rerange_index)
    check_group_args("cp_rerange", group_name, world_size)


def cp_rerange_decomposed(rows: Tensor, rerange_index: Tensor, group_name: str, world_size: int) -> Tensor:
    """Same result as ``cpgraph::cp_rerange``: functional all-gather, then ``cpgraph::take_rows``."""
    _check_rerange(rows, rerange_index, group_name, world_size)
    check_index_range("cp_rerange", "rerange_index", rerange_index, 0, world_size * rows.shape[0])
    gathered = all_gather_dim0(rows, group_name, world_size)
    return torch.ops.cpgraph.take_rows(gathered, rerange_index)


@torch.library.custom_op("cpgraph::cp_rerange", mutates_args=())
def cp_rerange(rows: Tensor, rerange_index: Tensor, group_name: str, world_size: int) -> Tensor:
    """Restore global valid order from the per-rank compute rows.

    ``rows``: this rank's ``[M, ...]`` compute rows (dummies included).
    ``rerange_index``: int64 ``[T]`` from the planner (``RankPlan.rerange_index``):
    for every extend token in global order (request 0's tokens, then
    request 1's, ...), its row in the rank-major ``[world_size * M]`` gather.
    Returns ``[T, ...]``; dummy rows never appear because no entry points at
    them.  The placement is the planner's, never recomputed here, so a
    single source of truth decides the layout.
    """
    _check_rerange(rows, rerange_index, group_name, world_size)
    resolve_group("cp_rerange", group_name, world_size)
    impl = select("cp_rerange", rows.device.type, cp_rerange_decomposed)
    return impl(rows, rerange_index, group_name, world_size)


@cp_rerange.register_fake
def _cp_rerange_fake(rows, rerange_index, group_name, world_size):
    _check_rerange(rows, rerange_index, group_name, world_size)
    return rows.new_empty((rerange_index.shape[0], *rows.shape[1:]))


# ------------------------------------------------------------ cp_last_tokens
def _check_last_tokens(rows, last_token_index, group_name, world_size) -> None:
    _check_rows("cp_last_tokens", rows)
    check_tensor("cp_last_tokens", "last_token_index", last_token_index, dtype=torch.int64, ndim=1)
    check_same_device("cp_last_tokens", rows=rows, last_token_index=last_token_index)
    check_group_args("cp_last_tokens", group_name, world_size)


def cp_last_tokens_decomposed(rows: Tensor, last_token_index: Tensor, group_name: str, world_size: int) -> Tensor:
    """Same result as ``cpgraph::cp_last_tokens``: a ``[B]``-row all-gather, then an owner pick.

    Every rank takes, for each request, the row at the *local* position the
    last token would have on its owner (``g % M``), so the graph is the same
    on every rank (no rank constant: the compiled artifact can be shared by
    all ranks through Inductor's cache).  After one all-gather of those
    ``[B, ...]`` rows, row ``b`` is read from owner ``g // M``'s block.
    """
    _check_last_tokens(rows, last_token_index, group_name, world_size)
    num_rows = rows.shape[0]
    check_index_range("cp_last_tokens", "last_token_index", last_token_index, 0, world_size * num_rows)
    local = last_token_index.remainder(num_rows)
    owner = last_token_index.div(num_rows, rounding_mode="floor")
    picked = rows.index_select(0, local)  # [B, ...] on every rank
    gathered = all_gather_dim0(picked, group_name, world_size)  # [world * B, ...]
    batch = last_token_index.shape[0]
    flat = owner * batch + torch.arange(batch, device=last_token_index.device)
    return gathered.index_select(0, flat)


@torch.library.custom_op("cpgraph::cp_last_tokens", mutates_args=())
def cp_last_tokens(rows: Tensor, last_token_index: Tensor, group_name: str, world_size: int) -> Tensor:
    """Narrow gather of each request's last token (the logits input): ``[B, ...]``.

    ``last_token_index``: int64 ``[B]`` (``RankPlan.last_token_index``), the
    row of request b's last valid token in the rank-major ``[world_size * M]``
    gather; its owner is rank ``g // M``.  Instead of gathering all
    ``world_size * M`` rows, each rank contributes ``B`` rows (the candidate
    at local row ``g % M``) and the owner's copy is kept: the traffic is
    O(world_size * B) rows instead of O(world_size * M), the result is a
    bit-exact copy in any dtype, and no rank index enters the graph.
    """
    _check_last_tokens(rows, last_token_index, group_name, world_size)
    resolve_group("cp_last_tokens", group_name, world_size)
    return cp_last_tokens_decomposed(rows, last_token_index, group_name, world_size)


@cp_last_tokens.register_fake
def _cp_last_tokens_fake(rows, last_token_index, group_name, world_size):
    _check_last_tokens(rows, last_token_index, group_name, world_size)
    return rows.new_empty((last_token_index.shape[0], *rows.shape[1:]))

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


# ------------------------------------------------------------ cp_rerange_p2p
# Per-rank payload (``M`` rows x row bytes) below which the P2P form takes the all-gather
# path inside the op (rerange_nccl_bench.py measures both around it; docs/ops/collectives.md).
RERANGE_P2P_MIN_BYTES = 8 << 20
# Process-group backends whose P2P transfers the compiled forward may rely on.
RERANGE_P2P_BACKENDS = ("nccl",)


def rerange_form(device_type: str, backend: str | None) -> str:
    """Which rerange the lowered CP forward uses: ``"p2p"`` or ``"all_gather"``.

    Static facts only (known when the graph is lowered, the same on every
    rank): P2P where the rows live on CUDA and the group runs NCCL (2 H200s:
    1.01x the raw all-gather at 128K tokens, 1.16x at 32K, against 1.26x and
    1.29x for all-gather + placement); the all-gather form elsewhere (CPU /
    gloo graphs, where a functional collective lets Inductor see the
    communication and nothing was measured to beat it).  The per-call size
    threshold is not decided here: rows per rank are symbolic at lowering
    time, so ``cp_rerange_p2p`` compares its payload with ``min_bytes`` when
    it runs (shape arithmetic, no sync, the same answer on every rank).
    """
    return "p2p" if device_type == "cuda" and (backend or "").lower() in RERANGE_P2P_BACKENDS else "all_gather"


def group_backend(group_name: str, device_type: str) -> str | None:
    """The backend the group named ``group_name`` uses for ``device_type`` tensors (``None`` if unknown).

    Host side, this process's group registry (read when lowering, and by
    the P2P provider); a group that cannot be resolved gives ``None``.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        spec = str(dist.get_backend(_resolve_process_group(group_name))).lower()
    except Exception:  # unknown name, no default group: nothing to rely on
        return None
    if ":" not in spec:
        return spec
    per_device = dict(item.split(":", 1) for item in spec.split(",") if ":" in item)
    return per_device.get(device_type)


def _check_rerange_p2p(rows, rerange_index, group_name, world_size, min_bytes) -> None:
    _check_rerange(rows, rerange_index, group_name, world_size)
    check_size_arg("cp_rerange_p2p", "min_bytes", min_bytes, 0)


def rerange_payload_bytes(rows: Tensor) -> int:
    """Bytes one rank contributes to a rerange (its ``M`` rows, dummies included)."""
    return rows.numel() * rows.element_size()


def exchange_blocks(rows: Tensor, group) -> Tensor:
    """``[world * M, ...]`` rank-major, like the all-gather, but from one P2P message per ordered pair.

    The reference transfer of ``cp_rerange_p2p`` (any backend with P2P:
    gloo on CPU, NCCL on CUDA).  Every message size is ``M`` rows (a shape),
    so no rank needs another rank's counts and nothing reads device data.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    m = rows.shape[0]
    rows = rows.contiguous()
    staging = rows.new_empty((world * m, *rows.shape[1:]))
    staging[rank * m : (rank + 1) * m].copy_(rows)
    ops = []
    for q in range(world):
        if q == rank or m == 0:
            continue
        peer = dist.get_global_rank(group, q)
        ops.append(dist.P2POp(dist.isend, rows, peer, group))
        ops.append(dist.P2POp(dist.irecv, staging[q * m : (q + 1) * m], peer, group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return staging


def cp_rerange_p2p_reference(
    rows: Tensor, rerange_index: Tensor, group_name: str, world_size: int, min_bytes: int
) -> Tensor:
    """Torch reference of ``cpgraph::cp_rerange_p2p``: P2P block exchange, then ``take_rows``."""
    _check_rerange_p2p(rows, rerange_index, group_name, world_size, min_bytes)
    if rerange_payload_bytes(rows) < min_bytes:
        return cp_rerange_decomposed(rows, rerange_index, group_name, world_size)
    check_index_range("cp_rerange_p2p", "rerange_index", rerange_index, 0, world_size * rows.shape[0])
    group = resolve_group("cp_rerange_p2p", group_name, world_size)
    return torch.ops.cpgraph.take_rows(exchange_blocks(rows, group), rerange_index)


@torch.library.custom_op("cpgraph::cp_rerange_p2p", mutates_args=())
def cp_rerange_p2p(rows: Tensor, rerange_index: Tensor, group_name: str, world_size: int, min_bytes: int) -> Tensor:
    """``cp_rerange`` as point-to-point transfers: same arguments and result, bit for bit, plus ``min_bytes``.

    What the lowered CP forward uses where :func:`rerange_form` says
    ``"p2p"``.  Each rank sends its ``M`` rows to every peer as one message
    (sizes are shapes: no host sync, capturable in a CUDA graph); the CUDA
    provider (``cpgraph.kernels.p2p``) places this rank's own rows on a side
    stream while the transfer runs and the peers' rows by one gather after
    it, so only ``(world - 1) / world`` of the placement follows the
    transfer.  Below ``min_bytes`` of payload per rank (see
    ``RERANGE_P2P_MIN_BYTES``) it runs the all-gather form instead: the same
    bytes, from the path that is faster for small messages.
    """
    _check_rerange_p2p(rows, rerange_index, group_name, world_size, min_bytes)
    resolve_group("cp_rerange_p2p", group_name, world_size)
    impl = select("cp_rerange_p2p", rows.device.type, cp_rerange_p2p_reference)
    return impl(rows, rerange_index, group_name, world_size, min_bytes)


@cp_rerange_p2p.register_fake
def _cp_rerange_p2p_fake(rows, rerange_index, group_name, world_size, min_bytes):
    _check_rerange_p2p(rows, rerange_index, group_name, world_size, min_bytes)
    return rows.new_empty((rerange_index.shape[0], *rows.shape[1:]))

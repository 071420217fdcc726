"""Expert parallelism over the CP group: ``cpgraph::moe_dispatch`` and ``cpgraph::moe_combine``.

Why: the routed experts are ~97% of a DeepSeek-V3.2 checkpoint.  With
expert parallelism (EP) rank ``r`` of ``W`` holds only experts
``[r*E/W, (r+1)*E/W)``, so a row's top-k routes must travel to the ranks
that hold those experts and the expert outputs must travel back.  These two
ops are that round trip, as ops so the compiler can insert them around
``cpgraph::moe_experts`` and graphs say what moves and why
(``docs/expert_parallel.md``).

Round trip (every rank, same collectives in the same order)::

    recv_x, recv_ids, num_recv, recv_order, send_slot = moe_dispatch(x, ids, num_valid, E, slots, g, W)
    y   = moe_experts(recv_x, recv_ids, ones, gate_up_local, down_local, num_recv)
    out = moe_combine(y, recv_order, send_slot, topk_w, g, W)

What is sent.  A pair ``(row m, slot j)`` is *routed* when ``m < num_valid``
(a real row: dummies never reach an expert) and ``0 <= ids[m, j] < E``.
Each routed pair is sent exactly once, to rank ``ids[m, j] // (E / W)``,
carrying the row and its *local* expert id.  Rows past ``num_valid`` take no
slot anywhere.

Static shapes.  The send buffer holds ``C = M * capacity_slots`` pair slots
per destination rank (``W * C`` rows in all), filled in pair order from the
front; unfilled slots carry zero rows and expert id ``-1``.  One
``all_to_all_single`` with equal splits moves the rows, a second the ids.
Nothing depends on data, so the ops are CUDA-graph capturable; the price is
that the wire always carries ``W * C`` rows (a provider with device-side
splits can send only the filled prefix of each block).  The receiver moves
its received pairs to a prefix (``num_recv`` of them, in wire order) so the
expert GEMMs only cover real pairs.

Capacity and overflow.  A row's top-k ids are distinct (the router takes a
top-k), so one destination receives at most ``min(top_k, E / W)`` pairs per
row: ``capacity_slots = min(top_k, E / W)`` is the worst case and no pair
can overflow.  A smaller value saves buffer space and wire bytes at the risk
of overflow: a pair past its destination's ``C`` slots is *not* dropped
silently -- without ``CPGRAPH_DEBUG`` its row's combined output is NaN (loud
downstream, no host sync); with ``CPGRAPH_DEBUG`` every rank raises
``ValueError`` before anything is sent (the ranks agree through one extra
all-reduce that only debug mode issues).

Combine.  Expert outputs go back along the same slots (one more
``all_to_all_single``) and each row takes ``sum_j w[m, j] * y[m, j]`` in fp32
over its routed slots, cast to ``x``'s dtype: the weights never travel.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor, debug_enabled
from .collectives import check_group_args, check_size_arg, resolve_group
from .providers import select

_funcol = torch.ops._c10d_functional
_INDEX = (torch.int64, torch.int32)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)

NOT_ROUTED = -1  # send_slot of a pair that goes nowhere (dummy row, id out of range)
OVERFLOW = -2  # send_slot of a routed pair that found its destination's slots full


# ----------------------------------------------------------------- checks
def _check_dispatch(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size) -> None:
    op = "moe_dispatch"
    check_tensor(op, "x", x, dtype=_FLOAT, ndim=2)
    check_tensor(op, "topk_ids", topk_ids, dtype=_INDEX, ndim=2, shape=(x.shape[0], None))
    if num_valid is not None:
        check_tensor(op, "num_valid", num_valid, dtype=_INDEX, shape=(1,))
    check_same_device(op, x=x, topk_ids=topk_ids, num_valid=num_valid)
    check_group_args(op, group_name, world_size)
    check_size_arg(op, "num_experts", num_experts, 1)
    check_size_arg(op, "capacity_slots", capacity_slots, 1)
    if isinstance(num_experts, int) and isinstance(world_size, int) and num_experts % world_size:
        raise ValueError(
            f"cpgraph.{op}: argument 'num_experts' ({num_experts}) must split evenly over world_size {world_size}"
        )


def _check_combine(y, recv_order, send_slot, topk_w, group_name, world_size) -> None:
    op = "moe_combine"
    check_tensor(op, "y", y, dtype=_FLOAT, ndim=2)
    check_tensor(op, "recv_order", recv_order, dtype=torch.int64, shape=(y.shape[0],))
    check_tensor(op, "send_slot", send_slot, dtype=torch.int64, ndim=2)
    check_tensor(op, "topk_w", topk_w, dtype=torch.float32, shape=tuple(send_slot.shape))
    check_same_device(op, y=y, recv_order=recv_order, send_slot=send_slot, topk_w=topk_w)
    check_group_args(op, group_name, world_size)


# ------------------------------------------------------------ the routing
class RankRoutes(NamedTuple):
    """Where every pair goes, with static shapes (``n = W * C`` wire slots).

    * ``send_row [n]`` int64: the row each wire slot carries, ``-1`` empty;
    * ``send_expert [n]`` int64: its local expert id at the destination, ``-1`` empty;
    * ``send_slot [M, k]`` int64: each pair's wire slot (``dest * C + position``),
      :data:`NOT_ROUTED` or :data:`OVERFLOW`.
    """

    send_row: Tensor
    send_expert: Tensor
    send_slot: Tensor


def route_to_ranks(topk_ids: Tensor, num_valid: Optional[Tensor], num_experts: int, world_size: int,
                   capacity: int) -> RankRoutes:
    """Assign every routed pair a slot in its destination's block: one stable sort, no host sync.

    Pairs keep their ``row * k + slot`` order within a destination, so the
    layout (and every result) is deterministic.
    """
    m, k = topk_ids.shape
    dev = topk_ids.device
    per_rank = num_experts // world_size
    ids = topk_ids.to(torch.int64)
    routed = (ids >= 0) & (ids < num_experts)
    if num_valid is not None:
        routed = routed & (torch.arange(m, device=dev) < num_valid.to(torch.int64).reshape(()))[:, None]
    dest = torch.where(routed, ids.div(per_rank, rounding_mode="floor"), torch.full((), world_size, device=dev))
    keys = dest.reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    group_start = torch.searchsorted(sorted_keys, torch.arange(world_size + 1, device=dev))
    pairs = torch.arange(m * k, device=dev)
    position = torch.empty_like(pairs).scatter_(0, order, pairs - group_start.index_select(0, sorted_keys))
    fits = routed.reshape(-1) & (position < capacity)
    n = world_size * capacity
    wire = torch.where(fits, keys * capacity + position, torch.full((), n, device=dev))  # n: a sentinel slot
    send_row = torch.full((n + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, wire, pairs.div(k, rounding_mode="floor"))
    local = ids.remainder(per_rank).reshape(-1)
    send_expert = torch.full((n + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, wire, local)
    lost = torch.full((), OVERFLOW, device=dev)
    nowhere = torch.full((), NOT_ROUTED, device=dev)
    send_slot = torch.where(fits, wire, torch.where(routed.reshape(-1), lost, nowhere)).view(m, k)
    return RankRoutes(send_row[:n], send_expert[:n], send_slot)


def _all_to_all(t: Tensor, group_name: str, world_size: int) -> Tensor:
    """Equal-split functional ``all_to_all_single`` along dim 0 (block ``d`` goes to rank ``d``)."""
    block = t.shape[0] // world_size
    out = _funcol.all_to_all_single(t.contiguous(), [block] * world_size, [block] * world_size, group_name)
    return _funcol.wait_tensor(out)


# ------------------------------------------------------------- moe_dispatch
def moe_dispatch_decomposed(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size):
    """Same result as ``cpgraph::moe_dispatch`` from two functional all-to-alls and placement ops."""
    _check_dispatch(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size)
    capacity = x.shape[0] * capacity_slots
    routes = route_to_ranks(topk_ids, num_valid, num_experts, world_size, capacity)
    rows = torch.ops.cpgraph.take_rows(x, routes.send_row)  # [W*C, H], zero rows in empty slots
    recv_x = _all_to_all(rows, group_name, world_size)
    recv_expert = _all_to_all(routes.send_expert, group_name, world_size)
    # Received pairs to a prefix (wire order kept) so the experts' work is bounded by num_recv.
    empty = recv_expert < 0
    recv_order = torch.sort(empty.to(torch.int8), stable=True).indices
    num_recv = (~empty).sum().reshape(1).to(torch.int64)
    ids = recv_expert.index_select(0, recv_order).clamp_min(0)  # empty slots (past num_recv) read expert 0
    return recv_x.index_select(0, recv_order), ids[:, None], num_recv, recv_order, routes.send_slot


def _debug_check_routes(topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size) -> None:
    """``CPGRAPH_DEBUG``: every rank raises if any rank has an id out of range or an overflowing pair.

    Host syncs and one all-reduce, debug mode only; run before the
    all-to-all so no rank waits in it for a peer that raised.
    """
    import torch.distributed as dist

    m = topk_ids.shape[0]
    capacity = m * capacity_slots
    valid_rows = m if num_valid is None else num_valid.reshape(())
    real = torch.arange(m, device=topk_ids.device)[:, None] < valid_rows
    bad_ids = (real & ((topk_ids < 0) | (topk_ids >= num_experts))).sum()
    overflow = (route_to_ranks(topk_ids, num_valid, num_experts, world_size, capacity).send_slot == OVERFLOW).sum()
    counts = torch.stack([bad_ids, overflow]).to(torch.int64)
    dist.all_reduce(counts, group=resolve_group("moe_dispatch", group_name, world_size))
    bad, lost = counts.tolist()  # sync-ok: debug flag only
    if bad:
        raise ValueError(f"cpgraph.moe_dispatch: 'topk_ids' has {bad} routed ids outside [0, {num_experts}) over the group")
    if lost:
        raise ValueError(
            f"cpgraph.moe_dispatch: {lost} routed pairs overflow the {capacity} slots per destination rank "
            f"(capacity_slots={capacity_slots}); raise it or use the worst case min(top_k, E / world_size)"
        )


@torch.library.custom_op("cpgraph::moe_dispatch", mutates_args=())
def moe_dispatch(
    x: Tensor,
    topk_ids: Tensor,
    num_valid: Optional[Tensor],
    num_experts: int,
    capacity_slots: int,
    group_name: str,
    world_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Send each routed ``(row, expert)`` pair to the rank holding the expert (module docstring).

    ``x [M, H]`` this rank's rows (real rows first); ``topk_ids [M, k]``
    global expert ids; ``num_valid`` int64 ``[1]`` real rows (``None``:
    all); ``num_experts`` E (divisible by ``world_size``);
    ``capacity_slots``: wire slots per row per destination (``C = M *
    capacity_slots``).  Returns, with ``n = world_size * C``:

    * ``recv_x [n, H]``: received rows, real pairs first (wire order), then zeros;
    * ``recv_ids int64 [n, 1]``: their local expert ids (0 past ``num_recv``);
    * ``num_recv int64 [1]``: received pairs;
    * ``recv_order int64 [n]``: the wire slot of each ``recv_x`` row (for the combine);
    * ``send_slot int64 [M, k]``: each pair's wire slot, ``-1`` not routed, ``-2`` overflow.
    """
    _check_dispatch(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size)
    resolve_group("moe_dispatch", group_name, world_size)
    if debug_enabled():
        _debug_check_routes(topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size)
    impl = select("moe_dispatch", x.device.type, moe_dispatch_decomposed)
    return impl(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size)


@moe_dispatch.register_fake
def _moe_dispatch_fake(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size):
    _check_dispatch(x, topk_ids, num_valid, num_experts, capacity_slots, group_name, world_size)
    n = world_size * x.shape[0] * capacity_slots
    index = dict(dtype=torch.int64)
    return (x.new_empty((n, x.shape[1])), topk_ids.new_empty((n, 1), **index), topk_ids.new_empty((1,), **index),
            topk_ids.new_empty((n,), **index), topk_ids.new_empty(tuple(topk_ids.shape), **index))


# -------------------------------------------------------------- moe_combine
def moe_combine_decomposed(y, recv_order, send_slot, topk_w, group_name, world_size):
    """Same result as ``cpgraph::moe_combine`` from one functional all-to-all and a weighted sum."""
    _check_combine(y, recv_order, send_slot, topk_w, group_name, world_size)
    wire = torch.empty_like(y).index_copy_(0, recv_order, y)  # recv_order is a permutation: every row written
    back = _all_to_all(wire, group_name, world_size)  # [n, H]: block d = what rank d computed for our pairs
    m, k = send_slot.shape
    used = send_slot >= 0
    safe = torch.where(used, send_slot, torch.zeros((), dtype=send_slot.dtype, device=send_slot.device))
    rows = back.index_select(0, safe.reshape(-1)).view(m, k, -1).float()
    rows = torch.where(used[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    out = (rows * topk_w[..., None]).sum(1)
    lost = (send_slot == OVERFLOW).any(1, keepdim=True)
    out = torch.where(lost, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)
    return out.to(y.dtype)


@torch.library.custom_op("cpgraph::moe_combine", mutates_args=())
def moe_combine(
    y: Tensor,
    recv_order: Tensor,
    send_slot: Tensor,
    topk_w: Tensor,
    group_name: str,
    world_size: int,
) -> Tensor:
    """Return expert outputs to their rows and apply the routing weights: ``[M, H]`` in ``y``'s dtype.

    ``y [n, H]``: the experts' output for ``moe_dispatch``'s ``recv_x``
    (zero rows past ``num_recv``); ``recv_order``, ``send_slot``: from the
    same ``moe_dispatch``; ``topk_w [M, k]`` fp32 routing weights.
    ``out[m] = sum_j topk_w[m, j] * y_j`` over routed slots (fp32), zero for
    rows with no routed slot, NaN for rows with an overflowed slot.
    """
    _check_combine(y, recv_order, send_slot, topk_w, group_name, world_size)
    resolve_group("moe_combine", group_name, world_size)
    impl = select("moe_combine", y.device.type, moe_combine_decomposed)
    return impl(y, recv_order, send_slot, topk_w, group_name, world_size)


@moe_combine.register_fake
def _moe_combine_fake(y, recv_order, send_slot, topk_w, group_name, world_size):
    _check_combine(y, recv_order, send_slot, topk_w, group_name, world_size)
    return y.new_empty((send_slot.shape[0], y.shape[1]))

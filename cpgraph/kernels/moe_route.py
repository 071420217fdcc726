"""CUDA provider of ``cpgraph::moe_route``: the group-limited top-k of a block of rows in one program.

Each program holds ``ROWS`` rows of the ``[M, E]`` scores in registers and
makes every choice of the op's contract (``cpgraph/ops/moe_route.py``) with max-reductions:

* values are compared through an **order key**, an int32 with the order of
  the contract: the fp32 bits flipped so that integer order is float order,
  ``-0.0`` folded onto ``0.0``, every NaN one key above ``+inf``;
* a pick is the largest key and, among equal keys, the lowest column (a
  min-reduction over the columns holding it), which is then knocked out;
* each group's two best, then the best groups, then the ``top_k`` experts
  of the kept groups; the weights are loaded from ``scores`` at the chosen
  columns (no arithmetic on them before the normalising sum, which runs in
  slot order with IEEE division, as the reference does).

So the ids and the weights equal the reference's bit for bit, and a row's
result depends on that row alone (CP = one device).  No host sync; static
shapes.  Rows wider than ``MAX_EXPERTS`` go to the reference (a WARNING
once): the DSA models have 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpgraph.ops import ledger
from cpgraph.ops.moe_route import NORM_EPS, check_moe_route, moe_route_reference

MAX_EXPERTS = 1024  # one row's key in registers: 1024 x ROWS int32 per program at the most
_KNOCKED = tl.constexpr(-2147483648)  # below every key (the smallest real key, -inf's, is -2139095041)
_NEG_INF_KEY = tl.constexpr(-2139095041)  # _order_key(-inf)
_EPS = tl.constexpr(NORM_EPS)
_NEG_ZERO_BITS = tl.constexpr(-2147483648)  # 0x80000000


@triton.jit
def _order_key(v):
    """An int32 whose signed order is the contract's order of the fp32 ``v`` (module docstring)."""
    bits = v.to(tl.int32, bitcast=True)
    # -0.0 (the sign bit alone) is 0.0: equal values, equal keys (an integer test; "v + 0.0" may be folded away)
    bits = tl.where(bits == _NEG_ZERO_BITS, 0, bits)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000  # exponent all ones, mantissa not zero (integer test, as above)
    return tl.where(nan, 0x7F800001, key)  # every NaN: one above +inf's key (0x7F800000)


@triton.jit
def _key_value(key):
    """The fp32 value of a key (the flip is its own inverse; a NaN key gives a NaN)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pick(key, cols, WIDTH: tl.constexpr):
    """Per row: the largest key and the lowest column holding it."""
    best = tl.max(key, axis=1)
    col = tl.min(tl.where(key == best[:, None], cols[None, :], WIDTH), axis=1)
    return best, col


@triton.jit
def _moe_route_kernel(
    scores, bias, ids, weights, M, E, per_group, scaling,
    EP: tl.constexpr, GP: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    NORM: tl.constexpr, ROWS: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, EP)
    row_ok = rows < M
    live = row_ok[:, None] & (cols[None, :] < E)
    base = rows.to(tl.int64)[:, None] * E
    s = tl.load(scores + base + cols[None, :], mask=live, other=0.0)
    choice = s + tl.load(bias + cols, mask=cols < E, other=0.0)[None, :]
    key = tl.where(live, _order_key(choice), _KNOCKED)
    group_of = cols // per_group

    # Each group's score: the sum of its two best choice values.
    gcols = tl.arange(0, GP)
    group_key = tl.full([ROWS, GP], _KNOCKED, tl.int32)
    for g in tl.static_range(N_GROUP):
        kg = tl.where(group_of[None, :] == g, key, _KNOCKED)
        first, at = _pick(kg, cols, EP)
        second = tl.max(tl.where(cols[None, :] == at[:, None], _KNOCKED, kg), axis=1)
        total = _key_value(first) + _key_value(second)
        group_key = tl.where(gcols[None, :] == g, _order_key(total)[:, None], group_key)

    # The kept groups; experts of the others count as -inf.
    kept = tl.zeros([ROWS, EP], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        _, g_at = _pick(group_key, gcols, GP)
        group_key = tl.where(gcols[None, :] == g_at[:, None], _KNOCKED, group_key)
        kept = kept | (group_of[None, :] == g_at[:, None])
    key = tl.where(kept & live, key, tl.where(live, _NEG_INF_KEY, _KNOCKED))

    # The experts, in slot order; their weights loaded from the scores at the chosen columns.
    kcols = tl.arange(0, KP)
    w_all = tl.zeros([ROWS, KP], dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        _, at = _pick(key, cols, EP)
        key = tl.where(cols[None, :] == at[:, None], _KNOCKED, key)
        w = tl.load(scores + rows.to(tl.int64) * E + at, mask=row_ok, other=0.0)
        total = w if j == 0 else total + w
        w_all = tl.where(kcols[None, :] == j, w[:, None], w_all)
        tl.store(ids + rows.to(tl.int64) * TOP_K + j, at.to(tl.int64), mask=row_ok)
    if NORM:
        w_all = tl.math.div_rn(w_all, (total + _EPS)[:, None])
    out = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    tl.store(weights + out, w_all * scaling, mask=row_ok[:, None] & (kcols[None, :] < TOP_K))


def moe_route(scores, bias, n_group: int, topk_group: int, top_k: int, norm: bool, scaling: float, *,
              rows_per_program: int = 16, num_warps: int = 4):
    """Provider: the op's ``(ids, weights)`` from one launch (module docstring)."""
    check_moe_route(scores, bias, n_group, topk_group, top_k)
    m, e = scores.shape
    if e > MAX_EXPERTS:
        ledger.fell_back("moe_route", scores.device.type, "reference", f"more than {MAX_EXPERTS} experts a row",
                         instead_of="triton")
        return moe_route_reference(scores, bias, n_group, topk_group, top_k, norm, scaling)
    ids = torch.empty((m, top_k), dtype=torch.int64, device=scores.device)
    weights = torch.empty((m, top_k), dtype=torch.float32, device=scores.device)
    if m == 0:
        return ids, weights
    scores, bias = scores.contiguous(), bias.contiguous()
    _moe_route_kernel[(triton.cdiv(m, rows_per_program),)](
        scores, bias, ids, weights, m, e, e // n_group, float(scaling),
        EP=triton.next_power_of_2(e), GP=triton.next_power_of_2(n_group), N_GROUP=n_group, TOPK_GROUP=topk_group,
        TOP_K=top_k, NORM=bool(norm), ROWS=rows_per_program, KP=triton.next_power_of_2(top_k), num_warps=num_warps,
    )  # fmt: skip
    return ids, weights


__all__ = ["moe_route", "MAX_EXPERTS"]

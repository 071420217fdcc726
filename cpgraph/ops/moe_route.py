"""Group-limited top-k routing of the DSA MoE layers: ``cpgraph::moe_route``.

Why an op: written in torch, the router's selection is three ``topk`` calls
(each group's best two experts, the best groups, the best experts of those
groups) with a scatter and a mask between them.  Inductor leaves ``topk`` to
ATen, so at DeepSeek-V3.2's sizes (256 experts in 8 groups, top-8) the three
launches and their sorts took about 1.2 ms per MoE layer at 32K rows on an
H200, for a ``[M, 256]`` input that is read in a few microseconds.  One
row-local kernel does the whole selection (docs/ops/moe.md).

Contract, per row (``scores`` fp32 ``[M, E]``, the sigmoid of the router's
logits; ``bias`` fp32 ``[E]``, the correction bias; ``P = E / n_group``)::

    choice   = scores + bias
    group[g] = the sum of the two largest choice values among experts g*P .. g*P+P-1
    kept     = the topk_group largest groups
    ids      = the top_k largest choice values among the kept groups' experts
    w        = scores[ids]; with norm: w / (w[0] + w[1] + ... + w[k-1] + 1e-20), summed in that order
    weights  = w * scaling

Order, so that every provider returns the same ids in the same slots:
larger first; NaN above every number (``torch.sort``'s order); equal values
(``-0.0`` equals ``0.0``) by lower index, for experts and groups alike.  The
slots come out in that order, and the weights' normalising sum runs over
them in slot order, so the provider and the reference agree bit for bit.
Experts of groups not kept count as ``-inf``.  Every output row depends only
on its own row: CP ranks and one device route a token the same way.

Returns ``(ids int64 [M, top_k], weights fp32 [M, top_k])``, what
``cpgraph::moe_experts`` takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .providers import select

OP = "moe_route"
NORM_EPS = 1e-20  # the normalising sum's guard, as in DeepSeek-V3.2's and GLM-5's routers


def check_moe_route(scores, bias, n_group, topk_group, top_k) -> None:
    """Metadata checks shared by the op, its fake rule and the provider (no data read)."""
    check_tensor(OP, "scores", scores, dtype=(torch.float32,), ndim=2)
    e = scores.shape[1]
    check_tensor(OP, "bias", bias, dtype=(torch.float32,), shape=(e,))
    check_same_device(OP, scores=scores, bias=bias)
    for name, v in (("n_group", n_group), ("topk_group", topk_group), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"cpgraph.{OP}: argument '{name}' must be a positive int, got {v!r}")
    if not isinstance(e, int):
        return  # a symbolic expert count: checked when the op runs
    if e % n_group or e // n_group < 2:
        raise ValueError(f"cpgraph.{OP}: {e} experts do not split into n_group={n_group} groups of >= 2 "
                         "(a group is scored by its two best experts)")
    if topk_group > n_group:
        raise ValueError(f"cpgraph.{OP}: argument 'topk_group' ({topk_group}) exceeds n_group ({n_group})")
    if top_k > topk_group * (e // n_group):
        raise ValueError(f"cpgraph.{OP}: argument 'top_k' ({top_k}) exceeds the {topk_group * (e // n_group)} "
                         f"experts of the kept groups")


def rank_desc(v: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest along the last dim: NaN first, ties by lower index (a stable sort)."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]


def moe_route_reference(scores, bias, n_group, topk_group, top_k, norm, scaling):
    """The contract in torch ops (the oracle; CPU's provider)."""
    m, e = scores.shape
    choice = scores + bias
    grouped = choice.view(m, n_group, e // n_group)
    best_two = grouped.gather(-1, rank_desc(grouped, 2))
    group_scores = best_two[..., 0] + best_two[..., 1]
    kept = torch.zeros((m, n_group), dtype=torch.bool, device=scores.device)
    kept.scatter_(1, rank_desc(group_scores, topk_group), True)
    masked = choice.masked_fill(~kept.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = rank_desc(masked, top_k).contiguous()
    w = scores.gather(1, ids)
    if norm:
        total = w[:, 0]
        for j in range(1, top_k):
            total = total + w[:, j]
        w = w / (total + NORM_EPS).unsqueeze(1)
    return ids, w * scaling


@torch.library.custom_op("cpgraph::moe_route", mutates_args=())
def moe_route(
    scores: Tensor, bias: Tensor, n_group: int, topk_group: int, top_k: int, norm: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    """``(ids int64 [M, top_k], weights fp32 [M, top_k])`` of each row (module docstring)."""
    check_moe_route(scores, bias, n_group, topk_group, top_k)
    impl = select(OP, scores.device.type, moe_route_reference)
    return impl(scores, bias, n_group, topk_group, top_k, norm, scaling)


@moe_route.register_fake
def _moe_route_fake(scores, bias, n_group, topk_group, top_k, norm, scaling):
    check_moe_route(scores, bias, n_group, topk_group, top_k)
    m = scores.shape[0]
    return scores.new_empty((m, top_k), dtype=torch.int64), scores.new_empty((m, top_k))


__all__ = ["moe_route", "moe_route_reference", "check_moe_route", "rank_desc", "NORM_EPS"]

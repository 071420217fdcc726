"""Mixture of experts: sigmoid router with correction bias, group-limited top-k.

Routing chooses what transformers 5.24 chooses (the selection is ``cpgraph::moe_route``,
which fixes the slot order and the tie rule): ``scores = sigmoid(x @ W^T)`` in
fp32; choice scores add ``e_score_correction_bias``; a group's score is the
sum of its two best choice scores; only the best ``topk_group`` groups stay
eligible; the top ``num_experts_per_tok`` eligible experts are taken; their
*uncorrected* sigmoid scores are normalised (``norm_topk_prob``) and scaled
by ``routed_scaling_factor``.  Shared experts are added unweighted.

Routed experts run through ``cpgraph::moe_experts`` (``cpgraph/ops/moe.py``):
the router hands over each row's top-k ``(ids, weights)`` and the device's
provider decides how to compute them -- the dense reference on CPU (exact,
row-local), a sort-by-expert dispatch with grouped GEMMs on CUDA (only the
routed FLOPs).  Shared experts stay a plain SwiGLU MLP.

Dummy rows (CP compute padding, static padding) never reach an expert: the
MoE is given the batch's row windows and counts the real rows (``ke > ks``);
by the planner's contract real rows form a prefix of the rows, and the CP
MoE pass keeps that true after compacting (docs/contracts.md).  The count
stays on the device, so nothing syncs.

Expert parallelism (``docs/expert_parallel.md``): a model built inside
:func:`expert_shard` (or cut by :func:`shard_experts`) holds only the routed
experts ``[start, stop)`` of rank ``r`` of ``ep`` (:func:`local_expert_range`);
router, shared experts and everything else stay whole.  The forward is still
the single-device one; the compiler's expert-parallel pass sends each row to
the ranks that hold its experts.  Run eagerly, a shard refuses to compute
(it would silently drop the routes to experts it does not hold).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import Tensor, nn

import cpgraph.ops.expert_parallel  # noqa: F401  (registers cpgraph::moe_dispatch / moe_combine)
import cpgraph.ops.moe  # noqa: F401  (registers cpgraph::moe_experts)
import cpgraph.ops.moe_route  # noqa: F401  (registers cpgraph::moe_route)

from .config import DSAConfig
from .fp32_linear import fp32_linear
from .layers import MLP

_ops = torch.ops.cpgraph


class Router(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        # Kept in fp32 whatever the model dtype (transformers does the same).
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(topk_ids int64 [rows, k], topk_w fp32 [rows, k])``: chosen experts and their combine weights.

        The scores are fp32 by the model's definition (``x`` is upcast for
        the ``[rows, E]`` logits only; nothing downstream keeps the copy).
        """
        scores = fp32_linear(x, self.weight).sigmoid()  # on CUDA: tensor cores, same product (models/fp32_linear.py)
        # The group-limited selection in one row-local op (cpgraph/ops/moe_route.py): ties by lower expert id.
        return _ops.moe_route(scores, self.e_score_correction_bias, self.n_group, self.topk_group, self.top_k,
                              self.norm_topk_prob, float(self.scaling))


# The expert range that Experts modules built in this context hold (None = all).
_LOCAL_EXPERTS: ContextVar[tuple[int, int] | None] = ContextVar("cpgraph_local_experts", default=None)


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """Experts ``[start, stop)`` that rank ``ep_rank`` of ``ep_size`` holds: ``E / ep`` consecutive ones.

    The expert-parallel dispatch sends expert ``e`` to rank ``e // (E / ep)``;
    this is the one place that layout is written down.
    """
    for name, v, lo in (("num_experts", num_experts, 1), ("ep_size", ep_size, 1), ("ep_rank", ep_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"expert parallel: {name} must be an int >= {lo}, got {v!r}")
    if ep_rank >= ep_size:
        raise ValueError(f"expert parallel: ep_rank {ep_rank} is outside [0, {ep_size})")
    if num_experts % ep_size:
        raise ValueError(
            f"expert parallel: {num_experts} routed experts do not split evenly over ep={ep_size} ranks"
        )
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def _check_range(experts, num_experts: int) -> tuple[int, int]:
    ok = isinstance(experts, (tuple, list)) and len(experts) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in experts)
    if not ok or not 0 <= experts[0] < experts[1] <= num_experts:
        raise ValueError(f"experts must be (start, stop) with 0 <= start < stop <= {num_experts}, got {experts!r}")
    return int(experts[0]), int(experts[1])


@contextmanager
def expert_shard(experts: tuple[int, int] | None) -> Iterator[None]:
    """Routed-expert modules built inside hold only experts ``[start, stop)`` (``None``: all).

    Why a context and not a constructor argument: the shard must exist from
    allocation on (a 690 GB model cannot be built whole and cut afterwards),
    and the modules that build ``Experts`` know nothing of parallelism.
    """
    token = _LOCAL_EXPERTS.set(None if experts is None else tuple(experts))
    try:
        yield
    finally:
        _LOCAL_EXPERTS.reset(token)


class Experts(nn.Module):
    """Routed experts stored stacked, as transformers 5 does: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    Under expert parallelism the stacks hold only ``expert_range`` (``E / ep``
    experts); ``num_experts`` stays the model's ``E``.
    """

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        start, stop = _check_range(_LOCAL_EXPERTS.get() or (0, E), E)
        self.num_experts = E
        self.expert_range = (start, stop)
        self.gate_up_proj = nn.Parameter(torch.empty(stop - start, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(stop - start, H, I))

    @property
    def is_shard(self) -> bool:
        return self.expert_range != (0, self.num_experts)

    def _refuse_eager_shard(self) -> None:
        if self.is_shard and not torch.compiler.is_compiling():
            start, stop = self.expert_range
            raise RuntimeError(
                f"Experts hold experts [{start}, {stop}) of {self.num_experts} (expert parallel); run the model "
                "through cpgraph.compile with CPConfig(ep=...), which sends rows to the ranks holding their experts"
            )

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor, num_valid: Tensor | None = None) -> Tensor:
        self._refuse_eager_shard()
        return _ops.moe_experts(x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, num_valid)


class FP8Experts(Experts):
    """Routed experts kept as the FP8 checkpoint stores them: e4m3 stacks plus fp32 block scales.

    ``gate_up_proj`` e4m3 ``[E, 2I, H]`` with ``gate_up_proj_scale_inv``
    ``[E, 2I / bo, ceil(H / bi)]`` (each expert's gate then up scale rows,
    so ``I`` must be a multiple of ``bo``), ``down_proj`` e4m3 ``[E, H, I]``
    with ``down_proj_scale_inv`` ``[E, ceil(H / bo), ceil(I / bi)]``;
    ``(bo, bi)`` is the checkpoint's block.  Computed by the same
    ``cpgraph::moe_experts`` op with the scales passed, so the compiler's MoE
    and expert-parallel passes see one kind of node.  Built from a dense
    :class:`Experts` by :func:`cpgraph.models.fp8.swap_fp8_linears`.
    """

    def __init__(self, like: Experts, block: tuple[int, int], act_scale_pow2: bool):
        nn.Module.__init__(self)
        n, two_i, h = like.gate_up_proj.shape
        i = two_i // 2
        bo, bi = block
        if i % bo:
            raise ValueError(f"FP8 experts need the intermediate size {i} to be a multiple of the block's {bo} rows")
        self.num_experts = like.num_experts
        self.expert_range = like.expert_range
        self.block = (int(bo), int(bi))
        self.act_scale_pow2 = bool(act_scale_pow2)
        dev = like.gate_up_proj.device

        def param(*shape, dtype):
            return nn.Parameter(torch.ones(*shape, dtype=torch.float32, device=dev).to(dtype), requires_grad=False)

        self.gate_up_proj = param(n, two_i, h, dtype=torch.float8_e4m3fn)
        self.gate_up_proj_scale_inv = param(n, two_i // bo, -(-h // bi), dtype=torch.float32)
        self.down_proj = param(n, h, i, dtype=torch.float8_e4m3fn)
        self.down_proj_scale_inv = param(n, -(-h // bo), -(-i // bi), dtype=torch.float32)

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor, num_valid: Tensor | None = None) -> Tensor:
        self._refuse_eager_shard()
        return _ops.moe_experts(x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, num_valid,
                                self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block[0], self.block[1],
                                self.act_scale_pow2)

    def extra_repr(self) -> str:
        start, stop = self.expert_range
        pow2 = ", ue8m0 activation scales" if self.act_scale_pow2 else ""
        return f"experts=[{start}, {stop}) of {self.num_experts}, e4m3, block={self.block[0]}x{self.block[1]}{pow2}"


def shard_experts(model: nn.Module, experts: tuple[int, int]) -> nn.Module:
    """Keep only routed experts ``[start, stop)`` in every ``Experts`` module of ``model`` (in place).

    For models already built whole (a random tiny model, a converted
    transformers model); the slices are copied so the whole stacks can be
    freed.  Loading a checkpoint for one rank should build the shard
    directly instead (``from_pretrained(..., ep_rank=, ep_size=)``).
    """
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        if module.is_shard:
            raise ValueError(f"shard_experts: the model already holds experts {module.expert_range} only")
        start, stop = _check_range(experts, module.num_experts)
        stacks = ["gate_up_proj", "down_proj"]
        if isinstance(module, FP8Experts):
            stacks += ["gate_up_proj_scale_inv", "down_proj_scale_inv"]
        with torch.no_grad():
            for name in stacks:
                old = getattr(module, name)
                setattr(module, name, nn.Parameter(old[start:stop].clone(), requires_grad=old.requires_grad))
        module.expert_range = (start, stop)
    return model


class MoE(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: Tensor, row_window: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``x [M, hidden]``; ``row_window = (ks, ke)`` of the batch's rows, or ``None`` when every row is real.

        Only the real-row *count* is taken from the windows (rows may have
        been permuted since, but real rows always lead); it bounds the
        experts' work on the device.
        """
        num_valid = None
        if row_window is not None:
            ks, ke = row_window
            num_valid = (ke > ks).sum().reshape(1).to(torch.int64)
        topk_ids, topk_w = self.gate(x)
        return self.experts(x, topk_ids, topk_w, num_valid) + self.shared_experts(x)

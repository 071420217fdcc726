"""Mixture of experts: sigmoid router with correction bias, group-limited top-k.

Routing follows transformers 5.24 exactly: ``scores = sigmoid(x @ W^T)`` in
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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import cpgraph.ops.moe  # noqa: F401  (registers cpgraph::moe_experts)

from .config import DSAConfig
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
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_keep = torch.zeros_like(group_scores).scatter(1, best_groups, 1.0)
        expert_keep = group_keep.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(expert_keep == 0, float("-inf"))
        chosen = choice.topk(self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, chosen)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return chosen, w * self.scaling


class Experts(nn.Module):
    """Routed experts stored stacked, as transformers 5 does: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor, num_valid: Tensor | None = None) -> Tensor:
        return _ops.moe_experts(x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, num_valid)


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

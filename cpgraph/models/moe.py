"""Mixture of experts: sigmoid router with correction bias, group-limited top-k.

Routing follows transformers 5.24 exactly: ``scores = sigmoid(x @ W^T)`` in
fp32; choice scores add ``e_score_correction_bias``; a group's score is the
sum of its two best choice scores; only the best ``topk_group`` groups stay
eligible; the top ``num_experts_per_tok`` eligible experts are taken; their
*uncorrected* sigmoid scores are normalised (``norm_topk_prob``) and scaled
by ``routed_scaling_factor``.  Shared experts are added unweighted.

Expert compute is **dense**: every row runs through every routed expert and
the outputs are combined with a ``[rows, experts]`` weight matrix that is
zero outside the row's top-k.  That keeps the forward free of
data-dependent shapes (no token dispatch, no ``nonzero``) and strictly
row-local, which is what the compiler needs; it costs ``E / top_k`` times
the routed FLOPs, fine for the tiny test models and the CPU oracle but not
for production-size checkpoints, where a static-capacity dispatch or grouped
GEMM provider replaces :meth:`Experts.forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DSAConfig
from .layers import MLP


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

    def forward(self, x: Tensor) -> Tensor:
        """Return the dense combine weights ``[rows, experts]`` (fp32, zero off the top-k)."""
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
        w = w * self.scaling
        return torch.zeros_like(scores).scatter(1, chosen, w)


class Experts(nn.Module):
    """Routed experts stored stacked, as transformers 5 does: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: Tensor, combine: Tensor) -> Tensor:
        gate, up = torch.einsum("mh,eoh->emo", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("emi,ehi->emh", F.silu(gate) * up, self.down_proj)  # [E, M, H]
        return torch.einsum("emh,me->mh", y, combine.to(y.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        return self.experts(x, self.gate(x)) + self.shared_experts(x)

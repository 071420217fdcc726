"""An independent plain-torch MTP draft forward (single device), and the tiny config the MTP tests share.

Written from the definition (DeepSeek-V3 technical report, sec. 2.2):
``h'_i = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])``, one decoder layer
(RMSNorm -> MLA -> residual -> RMSNorm -> MoE -> residual),
``logits = lm_head(shared_head.norm(.))``.  It reads weights from a state
dict by checkpoint name and nothing else from cpgraph: attention is the
textbook (non-absorbed) causal MLA with interleaved RoPE, the MoE is
DeepSeek-V3's sigmoid, group-limited routing.  Prompts must fit in the
indexer's ``index_topk`` so that the sparse selection is every causal key
(then DSA attention is exactly causal attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# DeepSeek-V3.2 style, default RoPE, every size tiny; index_topk covers every prompt the tests use.
CONFIG = {
    "model_type": "deepseek_v32",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "index_topk": 48,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
    "num_nextn_predict_layers": 1,
    "initializer_range": 0.1,
}
PAGE = 16


def build(draft: bool = True, seed: int = 0):
    """The cpgraph model of :data:`CONFIG` with seeded random weights (draft layer included by default)."""
    from cpgraph.models import DSAConfig, build_model, init_random

    return init_random(build_model(DSAConfig.from_hf_dict(CONFIG), draft=draft), seed=seed, std=0.1)


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names: the draft as ``model.layers.{N}.*`` (per-expert weights)."""
    N = CONFIG["num_hidden_layers"]
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        if name.startswith("mtp.block."):
            name = f"model.layers.{N}." + name[len("mtp.block."):]
        elif name.startswith("mtp."):
            name = f"model.layers.{N}." + name[len("mtp."):]
        m = name.rsplit(".", 1)
        if m[1] == "gate_up_proj":
            I = t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{m[0]}.{j}.gate_proj.weight"] = t[j, :I].clone()
                out[f"{m[0]}.{j}.up_proj.weight"] = t[j, I:].clone()
            continue
        if m[1] == "down_proj" and m[0].endswith("experts"):
            for j in range(t.shape[0]):
                out[f"{m[0]}.{j}.down_proj.weight"] = t[j].clone()
            continue
        out[name] = t.detach().clone()
    out[f"model.layers.{N}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
    out[f"model.layers.{N}.shared_head.head.weight"] = out["lm_head.weight"].clone()
    return out


def _rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, pos, theta):
    """Interleaved pairs ``(x[2i], x[2i+1])`` rotated by ``pos * theta^(-2i/d)``."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = b * ang.cos() + a * ang.sin()
    return out


def _mla(x, pos, w, p, c):
    H, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    L, n = c["kv_lora_rank"], x.shape[0]
    q = _rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], 1e-6) @ w[p + "q_b_proj.weight"].T
    q = q.view(n, H, nope + rope)
    q_nope, q_pe = q[..., :nope], _rope(q[..., nope:], pos, c["rope_theta"])
    kv_a = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    latent = _rms(kv_a[:, :L], w[p + "kv_a_layernorm.weight"], 1e-6)
    k_pe = _rope(kv_a[:, None, L:], pos, c["rope_theta"])
    kv = (latent @ w[p + "kv_b_proj.weight"].T).view(n, H, nope + v)
    k = torch.cat((kv[..., :nope], k_pe.expand(n, H, rope)), -1)
    qq = torch.cat((q_nope, q_pe), -1)
    scores = torch.einsum("ihd,jhd->hij", qq, k) * (nope + rope) ** -0.5
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("hij,jhd->ihd", attn, kv[..., nope:]).reshape(n, H * v)
    return out @ w[p + "o_proj.weight"].T, latent, k_pe[:, 0]


def _mlp(x, w, p):
    return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def _moe(x, w, p, c):
    E, G = c["n_routed_experts"], c["n_group"]
    scores = (x.float() @ w[p + "gate.weight"].float().T).sigmoid()
    choice = scores + w[p + "gate.e_score_correction_bias"]
    groups = choice.view(-1, G, E // G).topk(2, -1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter(1, groups.topk(c["topk_group"], -1).indices, 1.0)
    choice = choice.masked_fill(keep.repeat_interleave(E // G, 1) == 0, float("-inf"))
    ids = choice.topk(c["num_experts_per_tok"], -1).indices
    wts = scores.gather(1, ids)
    wts = wts / wts.sum(-1, keepdim=True) * 2.5  # norm_topk_prob, routed_scaling_factor (HF defaults)
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            pe = f"{p}experts.{e}."
            out[r] += wts[r, k].to(x.dtype) * _mlp(x[r : r + 1], w, pe)[0]
    return out + _mlp(x, w, p + "shared_experts.")


def draft_forward(w: dict, hidden: torch.Tensor, prompt: list[int], sampled: int, c: dict = CONFIG):
    """One request: ``hidden [n, H]`` the target's final-normed hidden states of ``prompt`` (all n tokens).

    Returns ``(logits at the last position [vocab], latent records [n, kv_lora], k_pe [n, rope])``.
    """
    N, eps = c["num_hidden_layers"], c["rms_norm_eps"]
    p = f"model.layers.{N}."
    nxt = torch.tensor(prompt[1:] + [sampled])
    pos = torch.arange(len(prompt))
    emb = w[p + "embed_tokens.weight"][nxt]
    x = torch.cat((_rms(emb, w[p + "enorm.weight"], eps), _rms(hidden, w[p + "hnorm.weight"], eps)), -1)
    x = x @ w[p + "eh_proj.weight"].T
    attn, latent, k_pe = _mla(_rms(x, w[p + "input_layernorm.weight"], eps), pos, w, p + "self_attn.", c)
    x = x + attn
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + _moe(h, w, p + "mlp.", c)
    logits = _rms(x[-1:], w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T
    return logits[0].float(), latent, k_pe

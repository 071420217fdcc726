"""The first token of a prefill: greedy or sampled, with its log-probability and the top alternatives.

A prefill node returns one token per request (decode generates the rest), so
sampling here is the first step of a completion.  Why log-probabilities of
the *unscaled* distribution: that is what OpenAI-style APIs report (the
``logprobs`` of a completion do not change with ``temperature``), and decode
sees the same numbers when it re-scores the token.

Sampling draws from ``softmax(logits / temperature)`` restricted to the
smallest set of tokens whose probability reaches ``top_p`` (the most likely
token always stays in).  A ``seed`` makes the draw reproducible for the same
logits: the generator is seeded per request, never shared between requests,
so a request's draw does not depend on what else was in its batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How the first token is chosen: ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class FirstToken:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; empty unless asked for


def choose_first_token(logits: Tensor, sampling: Sampling, top_logprobs: int = 0) -> FirstToken:
    """The first token of one request from its fp32 last-token logits ``[vocab]`` (host work, after the forward)."""
    return first_tokens(logits.reshape(1, -1), [sampling], [top_logprobs])[0]


def first_tokens(logits: Tensor, samplings, top_logprobs) -> list[FirstToken]:
    """:func:`choose_first_token` for every row of ``logits [B, vocab]`` (one sampling and top-k per row).

    Why batched: right after a forward the host's caches are cold, and each
    tensor op costs several times its warm price, so the per-request ops are
    few -- one copy to the host and one ``log_softmax`` for all rows (the
    same kernel per row as for a single row, so the same values); a greedy
    row's argmax and its logprob are read from the host arrays.  A sampled
    row draws with torch as before (same generator, same numbers).
    """
    rows = logits.detach() if logits.requires_grad else logits
    if rows.dtype != torch.float32:  # each no-op conversion would still be a dispatcher call (cold, after a forward)
        rows = rows.float()
    if not rows.is_cpu:  # (a flag: ``.device`` builds a device object)
        rows = rows.cpu()
    logp = torch.log_softmax(rows, dim=-1)
    rows_np, logp_np = rows.numpy(), logp.numpy()
    out = []
    for j, (sampling, k) in enumerate(zip(samplings, top_logprobs)):
        if sampling.greedy:
            token = int(rows_np[j].argmax())  # the first maximum (a NaN counts as one), as torch.argmax
        else:
            token = _draw(rows[j], sampling)
        top: list[tuple[int, float]] = []
        if k > 0:
            vals, ids = torch.topk(logp[j], min(int(k), rows.shape[1]))
            top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
        out.append(FirstToken(token, float(logp_np[j, token]), top))
    return out


def _draw(row: Tensor, sampling: Sampling) -> int:
    probs = torch.softmax(row / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        order = torch.argsort(probs, descending=True, stable=True)
        sorted_p = probs[order]
        # Keep a token while the mass of the tokens before it is below top_p (the first is always kept).
        keep = (torch.cumsum(sorted_p, 0) - sorted_p) < sampling.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    gen = torch.Generator()
    gen.manual_seed(sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return int(torch.multinomial(probs, 1, generator=gen))

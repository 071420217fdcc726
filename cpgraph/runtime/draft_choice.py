"""The first token of a prompt served with the MTP draft: chosen on every CP rank, alike.

Why every rank chooses: the draft runs right after the target in the same
step and reads the chosen token at each finished prompt's last row, which
may sit on any rank -- so the followers choose too, with no extra
collective.  They agree because they see the same logits and apply the same
rule with the same seed: the leader fixes a random seed for an unseeded
sampled request at admission (:func:`_random_seed`) and the ``admit`` op
carries it (docs/mtp.md, "Served by cpgraph serve").
"""

from __future__ import annotations

import os

import torch

from .sampling import first_tokens


def choose_first_tokens(logits, lives: list, chunks: list, picked: dict):
    """Every rank, between the target's forward and the draft's: the first token of each request whose last
    chunk ran (same logits, same rule and seed on every rank: the admit op carries them), as the ``[B]`` ids
    the draft reads at those rows (0 elsewhere: rows inside a prompt read the prompt's next token)."""
    ends = [j for j, (live, (_, _, e)) in enumerate(zip(lives, chunks)) if e == len(live.tokens)]
    ids = torch.zeros(len(chunks), dtype=torch.int64)
    if ends:
        sel = logits if len(ends) == logits.shape[0] else logits[ends]
        tops = [lives[j].handle.request.top_logprobs if lives[j].handle is not None else 0 for j in ends]
        for j, c in zip(ends, first_tokens(sel, [lives[j].sampling for j in ends], tops)):
            picked[j] = c
            ids[j] = c.token
    return ids


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1

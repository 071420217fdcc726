"""What ``cpgraph run`` and ``cpgraph launch`` print and write: prompts, top tokens, providers, the cache report.

A module of its own because every way of running prints through it: ``run`` on one device
(:mod:`cpgraph.cli_run_single`), with ``--cache`` (:mod:`cpgraph.cli_run_cache`) and with ``--cp``
(:mod:`cpgraph.cli_run_cp`), and ``launch`` (:mod:`cpgraph.cli_launch`), which prints and writes its
results with ``run``'s helpers (:class:`Prompts`, :func:`print_top`, :func:`run_payload`), so the lines
and the ``--json`` keys stay the same whichever runs.
"""

from __future__ import annotations

import json


class Prompts:
    """The run's prompts as token ids, with the texts they came from and the tokenizer that encoded them.

    ``texts[i]`` is ``None`` for a prompt given as ids; ``tokenizer`` is
    ``None`` when no prompt was text (the top tokens are then printed as
    ids only).
    """

    def __init__(self, raw: list, ids: list[list[int]], tokenizer) -> None:
        self.texts = [p if isinstance(p, str) else None for p in raw]
        self.ids = ids
        self.tokenizer = tokenizer

    def decode_each(self, ids: list[int]) -> list[str] | None:
        """Each id as its own text (``None`` without a tokenizer)."""
        if self.tokenizer is None:
            return None
        from cpgraph.models.tokenizer import decode_ids

        return decode_ids(self.tokenizer, [[t] for t in ids])

    def label(self, i: int) -> str:
        text = self.texts[i]
        if text is None:
            return f"prompt {i}"
        return f"prompt {i} {(text if len(text) <= 40 else text[:37] + '...')!r}"


def top_ids(args, logits) -> list[list[int]]:
    return logits.topk(min(args.top, logits.shape[1]), dim=-1).indices.tolist()


def print_top(args, prompts: Prompts, prefix, logits, draft=None) -> list[list[int]]:
    """Print each prompt's top last-token ids (decoded beside them when the prompts were text); returns them.

    ``draft``: ``(sampled, draft_logits)``; each prompt's MTP draft line then follows its target line.
    """
    top = top_ids(args, logits)
    draft_top = top_ids(args, draft[1]) if draft is not None else None
    for i, (p, ids) in enumerate(zip(prompts.ids, top)):
        words = prompts.decode_each(ids)
        shown = f" = {words}" if words is not None else ""
        cached = f" (prefix {prefix[i]})" if prefix is not None else ""
        print(f"{prompts.label(i)}: {len(p)} tokens{cached}: top ids {ids}{shown}")
        if draft_top is not None:
            print_draft_line(prompts, i, int(draft[0][i]), draft_top[i])
    return top


def print_draft_line(prompts: Prompts, i: int, sampled: int, ids: list[int]) -> None:
    """One prompt's MTP draft top ids: its guess for the token after the target's sampled token."""
    words = prompts.decode_each(ids)
    shown = f" = {words}" if words is not None else ""
    print(f"{prompts.label(i)}: draft (MTP) after target token {sampled}: top ids {ids}{shown}")


def text_payload(prompts: Prompts, top) -> dict:
    """``--json`` keys of a run with text prompts: the texts and each top id decoded."""
    if prompts.tokenizer is None:
        return {}
    return {"texts": prompts.texts, "top_text": [prompts.decode_each(ids) for ids in top]}


def run_payload(args, prompts: Prompts, prefix, logits, top, **extra) -> dict:
    """The ``--json`` document: the same keys with or without ``--cp``, plus run-specific extras."""
    return {"logits": logits.tolist(), "tokens": prompts.ids, "top_ids": top, "model": str(args.model),
            "kv_format": args.kv_format, "prefix_lens": prefix, **text_payload(prompts, top), **extra}


def print_providers(device_type: str, calls: dict[str, list[dict]], graph_replays: int = 0) -> None:
    """One block: per cpgraph op that ran, the implementations that computed its calls, with counts and reasons."""
    from cpgraph.ops.ledger import describe

    if not calls:
        print(f"op providers on {device_type}: no cpgraph op ran")
        return
    print(f"op providers on {device_type} ({len(calls)} cpgraph ops ran; calls per implementation that computed "
          f"them, eager and compiled; CPGRAPH_PROVIDERS=reference forces the torch references):")
    for op, rows in calls.items():
        print(f"  {op}: {describe(rows)}")
    if graph_replays:
        print(f"  + {graph_replays} CUDA-graph replay(s), not counted above: a replay runs no Python; it re-runs "
              f"the kernels its capture recorded (the warm-up and capture calls are counted)")


def cuda_graph_replays(forward) -> int:
    """Replays of captured CUDA graphs behind a ``graphed_forward`` (no Python ran for them: not in the counts)."""
    return sum(s["replays"] for r in getattr(forward, "runners", {}).values() for s in r.capture_report()
               if s["captured"])


def write_json(path: str, payload: dict, progress) -> None:
    with open(path, "w") as f:
        json.dump(payload, f)
    progress(f"wrote {path}")


def print_cache(hits, evicted, load_misses, second, first) -> bool:
    """Print hits per level of both passes and the warm-vs-cold logits comparison; True if they match."""
    for n, h in enumerate(hits, start=1):
        l3 = f", L3 (store) hit {h['l3']} token(s)" if "l3" in h else ""
        print(f"pass {n}: L1 (device) hit {h['device']} token(s), L2 (host) hit {h['host']} token(s){l3}, "
              f"computed {h['computed']} token(s)")
    if evicted:
        print(f"between passes: evicted {evicted} page(s) from L1 to L2; load-backs degraded to a miss: {load_misses}")
    return print_cache_compare(None, second, first)


def print_cache_compare(what: str | None, second, first) -> bool:
    """One line: the warm pass's logits (``what``: whose; default the target's) against the cold pass's."""
    import torch

    diff = (second - first).abs().max().item()
    same = torch.equal(second, first)
    ok = diff <= 1e-4 * max(first.abs().max().item(), 1e-30)
    print(f"{what + ' ' if what else ''}second pass vs first pass: max |diff| {diff:.3e}"
          f"{' - bit-identical' if same else ''}{'' if ok else ' - MISMATCH'}")
    return ok

"""``cpgraph run`` on one device, eager: the prompts in batches, with the MTP draft (``--draft``) after the target.

Apart from the ``--cache`` and ``--cp`` runs because it is the plain prefill (:func:`cpgraph.models.prefill.prefill`)
with no cache engine and no ranks; it is the baseline the others are checked against.
"""

from __future__ import annotations

from cpgraph.cli_run_output import Prompts, print_providers, print_top, run_payload, top_ids, write_json


def run_single(args, model, prompts: Prompts, prefix, progress) -> int:
    import time

    import torch

    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, prefill
    from cpgraph.ops.providers import calls, reset_calls, selected
    from cpgraph.runtime.engine import weight_bytes_per_rank

    reset_calls()  # the report covers this run's calls only
    ids = prompts.ids
    bs = args.batch_size if args.batch_size is not None else len(ids)
    logits, kv_bytes, draft_logits, sampled = [], 0, [], []
    t0 = time.perf_counter()
    batches = range(0, len(ids), bs)
    for n, start in enumerate(batches):
        sl = slice(start, start + bs)
        if len(batches) > 1:
            progress(f"batch {n + 1}/{len(batches)}: prompts {start}..{min(start + bs, len(ids)) - 1}")
        if args.draft:
            res = _prefill_with_draft(model, ids[sl], prefix[sl], args.kv_format, progress)
            draft_logits.append(res.draft_logits.float().cpu())
            sampled += res.sampled.tolist()
        else:
            res = prefill(model, ids[sl], prefix_lens=prefix[sl], kv_format=args.kv_format,
                          page_size=DEFAULT_PAGE_SIZE, progress=progress)
        logits.append(res.logits.float().cpu())
        kv_bytes = max(kv_bytes, res.kv_bytes)
    elapsed = time.perf_counter() - t0
    out = torch.cat(logits)
    draft_extra, draft = {}, None
    if args.draft:
        draft_out = torch.cat(draft_logits)
        draft = (sampled, draft_out)
        draft_extra = {"draft_logits": draft_out.tolist(), "draft_top_ids": top_ids(args, draft_out),
                       "draft_after": sampled}
    top = print_top(args, prompts, prefix, out, draft)
    tokens = sum(len(p) for p in ids)
    weight_bytes = weight_bytes_per_rank(model)
    print(
        f"{len(ids)} prompts, {tokens} tokens in {elapsed:.3f} s ({tokens / max(elapsed, 1e-9):.0f} tok/s); "
        f"KV cache {args.kv_format}: {kv_bytes} bytes used (largest batch); weights: {weight_bytes} bytes"
    )
    providers, op_calls = selected(model.device.type), calls(model.device.type)
    print_providers(model.device.type, op_calls)
    if args.json:
        payload = run_payload(args, prompts, prefix, out, top, kv_bytes=kv_bytes, weight_bytes=weight_bytes,
                              weights=args.weights or "dequantize", device=args.device, providers=providers,
                              provider_calls=op_calls, seconds=elapsed, **draft_extra)
        write_json(args.json, payload, progress)
    return 0


def _prefill_with_draft(model, ids, prefix, kv_format: str, progress):
    """One eager single-device batch with the MTP draft run after the target (``run_prefill(draft=...)``)."""
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, make_layout
    from cpgraph.runtime.engine import run_prefill

    model.kv_layout = make_layout(model, kv_format, DEFAULT_PAGE_SIZE)

    def forward(i, meta, mla, index, **kw):
        return model(i, meta, mla, index, **kw)

    return run_prefill(forward, model, ids, prefix_lens=prefix, kv_format=kv_format, page_size=DEFAULT_PAGE_SIZE,
                       progress=progress, draft=model.draft_module())

"""Human-readable map of a :class:`CPPlan` (the ``cpgraph plan`` report)."""

from __future__ import annotations

import numpy as np

from .plan import CPPlan


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """Group equal consecutive values: ``[(start, end_exclusive, value), ...]``."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if out and out[-1][2] == v and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1, v)
        else:
            out.append((i, i + 1, v))
    return out


def _span(a: int, b: int) -> str:
    return f"{a}" if b - a == 1 else f"{a}-{b - 1}"


def render_plan(plan: CPPlan) -> str:
    ps, cp = plan.page_size, plan.cp_size
    lines = [
        f"CP prefill plan: {plan.num_requests} request(s), {plan.num_tokens} extend token(s), "
        f"cp={cp}, page={ps}, row_align={plan.row_align}",
        "",
        "Requests (extend pages -> owner rank; page numbers are logical pages of the request):",
    ]
    for i in range(plan.num_requests):
        pre, ext = int(plan.prefix_lens[i]), int(plan.extend_lens[i])
        first = pre // ps
        owners = plan.page_owners(i)
        runs = ", ".join(f"p{_span(first + a, first + b)}->r{v}" for a, b, v in _runs(owners))
        rank, row = plan.last_token_owner(i)
        lines.append(
            f"  req {i}: prefix {pre} ({first} cached page(s)), extend {ext} "
            f"({len(owners)} page(s), tail slack {int(plan.page_tail_slack[i])})"
        )
        lines.append(f"         pages: {runs}")
        lines.append(f"         last token (pos {pre + ext - 1}) on rank {rank}, row {row}")
    lines += ["", f"Ranks (M = {plan.num_rows} rows each):"]
    for r in range(cp):
        rp = plan.rank(r)
        req = rp.req_index.numpy()
        tok = rp.positions.numpy()
        parts = []
        for a, b, v in _runs(req.tolist()):
            if v < 0:
                continue
            # A request's rows on a rank may be two position runs (prev + next chunk).
            pos = tok[a:b]
            breaks = np.flatnonzero(np.diff(pos) != 1) + 1
            for seg in np.split(pos, breaks):
                parts.append(f"req{v}[pos {_span(int(seg[0]), int(seg[-1]) + 1)}]")
        pad = rp.compute_padding + rp.static_padding
        dummy = f"row(s) {_span(rp.num_valid, rp.num_rows)}" if pad else "none"
        lines.append(f"  rank {r}: {rp.num_valid} valid row(s): {' '.join(parts) if parts else '(none)'}")
        lines.append(
            f"          dummy rows: {dummy} ({rp.compute_padding} compute padding, "
            f"{rp.static_padding} static padding)"
        )
    lines += [
        "",
        "Padding by domain:",
        f"  page-tail slack (allocated, never valid): {int(plan.page_tail_slack.sum())} position(s) "
        f"{plan.page_tail_slack.tolist()} per request",
        f"  CP compute padding (dummy rows to equal M): {int(plan.compute_padding.sum())} row(s) "
        f"{plan.compute_padding.tolist()} per rank",
        f"  static padding (row_align={plan.row_align}): {plan.static_padding} row(s) per rank",
    ]
    return "\n".join(lines)

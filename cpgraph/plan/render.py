"""Human-readable map of a :class:`CPPlan` (the ``cpgraph plan`` report).

The report is built from the plan's chunk table (owner runs per request,
row runs per rank), never from per-token or per-page rows, so its cost is
O(requests * cp) -- the size of the text it prints -- whatever the lengths.
"""

from __future__ import annotations

from .plan import CPPlan


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
        owner_runs = plan.page_owner_runs(i)
        runs = ", ".join(f"p{_span(first + a, first + b)}->r{v}" for a, b, v in owner_runs)
        n_pages = int(plan.num_pages[i])
        rank, row = plan.last_token_owner(i)
        lines.append(
            f"  req {i}: prefix {pre} ({first} cached page(s)), extend {ext} "
            f"({n_pages} page(s), tail slack {int(plan.page_tail_slack[i])})"
        )
        lines.append(f"         pages: {runs}")
        lines.append(f"         last token (pos {pre + ext - 1}) on rank {rank}, row {row}")
    lines += ["", f"Ranks (M = {plan.num_rows} rows each):"]
    compute_padding = plan.compute_padding
    for r in range(cp):
        merged: list[list[int]] = []  # a rank's prev and next chunks of one request may touch: print one run
        for i, a, b in plan.rank_segments(r):
            if merged and merged[-1][0] == i and merged[-1][2] == a:
                merged[-1][2] = b
            else:
                merged.append([i, a, b])
        parts = [f"req{i}[pos {_span(a, b)}]" for i, a, b in merged]
        num_valid = int(plan.valid_per_rank[r])
        comp, static = int(compute_padding[r]), plan.static_padding
        dummy = f"row(s) {_span(num_valid, plan.num_rows)}" if comp + static else "none"
        lines.append(f"  rank {r}: {num_valid} valid row(s): {' '.join(parts) if parts else '(none)'}")
        lines.append(f"          dummy rows: {dummy} ({comp} compute padding, {static} static padding)")
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

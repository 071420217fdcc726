"""The memory plan as a table for a terminal (``cpgraph memory``).

Why apart: presentation only -- one unit for the whole table, every figure
also in bytes -- over a finished :class:`MemoryPlan`.
"""

from __future__ import annotations

from .plan import MemoryPlan
from .weights import PARTS

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def _unit(total: int) -> tuple[int, str]:
    """One unit for a whole table: the largest that keeps the total >= 1."""
    return next(((d, u) for d, u in _UNITS if total >= d), (1, "B"))


def render_memory(plan: MemoryPlan) -> str:
    """The plan as a table for a terminal (``cpgraph memory``); every figure also in bytes."""
    p = plan
    div, unit = _unit(p.total_bytes)

    def row(label: str, n: int, note: str = "") -> str:
        return f"  {label:<16}{n / div:12.2f} {unit:<3} {n:>18,} B{note}"

    lines = [f"{p.model_type}: {p.tokens} tokens on CP {p.cp} x EP {p.ep}, weights {p.dtype}, KV {p.kv_format} "
             f"(index-K {p.index_format}), page {p.page_size} -- bytes per rank", "", "weights"]
    lines += [row(name, p.weights[name]) for name in PARTS]
    lines.append(row("total", p.weight_bytes))
    per_tok = sum(p.kv_per_token.values())
    lines += ["", f"KV cache: {p.kv_per_token['mla']} B/token MLA + {p.kv_per_token['index']} B/token index-K "
                  f"= {per_tok} B/token (all layers); owner-sharded, {p.pages_per_rank} of {p.pages_total} pages",
              row("owned", p.kv_bytes), row("if replicated", p.kv_replicated_bytes),
              "", f"activations: one forward of {p.rows} rows per rank against {p.keys} keys, routed experts "
                  f"{p.experts_provider}" + (" (deterministic mode)" if p.deterministic else "")]
    lines.append(row("base", p.activation_base))
    for name, b in p.activation_phases.items():
        lines.append(row("+ " + name, b, "  <- peak" if name == p.peak_phase else ""))
    lines.append(row("peak", p.activation_peak))
    lines += ["", row("total", p.total_bytes)]
    return "\n".join(lines)

"""The bundled tiny GLM-5 with its seeded MTP draft, as the served-draft tests use it (eager, one device)."""

from __future__ import annotations

from cpgraph.models import from_pretrained
from cpgraph.models.prefill import make_layout


def tiny_with_draft(page_size: int):
    """``(model, forward, draft)``: the eager target forward as an engine calls it, and the draft module."""
    model = from_pretrained("tiny-glm5", draft=True).eval()
    model.kv_layout = make_layout(model, "bf16", page_size)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    return model, forward, model.draft_module()

"""cpgraph: context-parallel prefill of DeepSeek-Sparse-Attention models under torch.compile.

The public entry points:

* ``cpgraph.compile(model, cp=cpgraph.CPConfig(group, cp_size=N))`` -- compile an
  unmodified single-device model into the CP prefill (``docs/passes.md``);
* ``cpgraph.plan.plan_prefill`` -- the deterministic CP split (``docs/plan.md``);
* ``cpgraph.models`` -- DeepSeek-V3.2 / GLM-5 and ``prefill_logits`` (``docs/models.md``).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that ``import cpgraph`` (and the CLI) stay light.
    if name in ("compile", "CPConfig"):
        from . import passes

        return getattr(passes, name)
    raise AttributeError(f"module 'cpgraph' has no attribute {name!r}")

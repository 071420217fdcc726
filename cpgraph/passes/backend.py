"""``cpgraph.compile``: the one public entry point of the compiler.

All compile flags are visible here.  ``backend="inductor"`` installs the pass
manager as Inductor's ``post_grad_custom_pre_pass`` (absorbing whatever pass
a user already put in that slot).  The *pre* slot of the post-grad passes is
chosen on purpose: there the graph is exactly the functionalised AOT graph
the ``aot_eager`` path sees (both backends rewrite the same graph), and
Inductor's own pattern passes and fusion then run on the CP graph; ``backend="aot_eager"`` runs the same
passes on the same functionalised AOT graph and then executes it eagerly,
which is what tests use when Inductor's code generation is not under test.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor import config as inductor_config

from .config import CPConfig
from .manager import CPPassManager, PassFn
from .pipeline import default_passes


def build_pass_manager(cp: CPConfig | None = None, passes: Sequence[tuple[str, PassFn]] | None = None, absorbed=None) -> CPPassManager:
    cfg = cp or CPConfig()
    return CPPassManager(cfg, default_passes() if passes is None else passes, absorbed=absorbed)


def _eager_runner(gm):
    def run(args):
        return torch.fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


def aot_eager_with_passes(manager: CPPassManager):
    """A ``torch.compile`` backend: AOT functionalisation, cpgraph passes, eager execution."""

    def fw_compiler(gm, example_inputs):
        manager.run(gm)
        return _eager_runner(gm)

    return aot_autograd(fw_compiler=fw_compiler)


def compile(
    model,
    cp: CPConfig | None = None,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = True,
    passes: Sequence[tuple[str, PassFn]] | None = None,
):
    """Compile ``model`` (or any callable) with cpgraph's passes.

    ``cp`` selects the CP group and pass options (default: single device).
    ``mode="reduce-overhead"`` captures CUDA graphs (Inductor only).  The
    returned callable has a ``cpgraph_passes`` attribute: the pass manager,
    whose ``history`` holds op counts before and after each pass.
    """
    if backend == "inductor":
        manager = build_pass_manager(cp, passes, absorbed=inductor_config.post_grad_custom_pre_pass)
        options = {"post_grad_custom_pre_pass": manager}
        if mode == "reduce-overhead":
            options["triton.cudagraphs"] = True
        elif mode not in (None, "default"):
            raise ValueError(f"cpgraph.compile: unsupported mode {mode!r} (use None or 'reduce-overhead')")
        compiled = torch.compile(model, backend="inductor", options=options, dynamic=dynamic, fullgraph=fullgraph)
    elif backend == "aot_eager":
        if mode is not None:
            raise ValueError("cpgraph.compile: mode applies to the inductor backend only")
        manager = build_pass_manager(cp, passes)
        compiled = torch.compile(model, backend=aot_eager_with_passes(manager), dynamic=dynamic, fullgraph=fullgraph)
    else:
        raise ValueError(f"cpgraph.compile: backend must be 'inductor' or 'aot_eager', got {backend!r}")
    try:
        compiled.cpgraph_passes = manager
    except AttributeError:  # some callables refuse attributes; the manager is still reachable via options
        pass
    return compiled

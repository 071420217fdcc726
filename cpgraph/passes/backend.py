"""``cpgraph.compile``: the one public entry point of the compiler.

All compile flags are visible here.  ``backend="inductor"`` installs the pass
manager as Inductor's ``post_grad_custom_pre_pass`` (absorbing whatever pass
a user already put in that slot).  The *pre* slot of the post-grad passes is
chosen on purpose: there the graph is exactly the functionalised AOT graph
the ``aot_eager`` path sees (both backends rewrite the same graph), and
Inductor's own pattern passes and fusion then run on the CP graph; ``backend="aot_eager"`` runs the same
passes on the same functionalised AOT graph and then executes it eagerly,
which is what tests use when Inductor's code generation is not under test.

Every call of the compiled callable traces under two Dynamo settings
(``trace_settings``): floats specialized and duck sizing off.  The model's
floats (norm eps, softmax and index scales) are constants; traced as
``dynamic=True``'s symbolic floats one of them cannot stay symbolic and
Dynamo restarts, tracing every graph twice for the same code.  Duck sizing
gives dims of equal size one symbol, so a pool whose row count happens to
equal a record width gets a graph specialized to it and recompiles on the
next batch.  Both are applied per call (not process-wide): the caller's own
``torch.compile`` settings stay as they were.  The same per-call scope turns
Dynamo's recompile-limit fallback to eager into a clear error
(:mod:`.recompile_limit`).

The compiled callable is an inference forward: it runs under
``torch.no_grad()`` whatever the caller's grad mode.  Why: cpgraph compiles
a prefill, which has no backward, and its ops (``row_scope``, the sparse
attention, the paged stores that mutate KV pools) register none.  With grad
enabled and parameters that require grad (every ``nn.Module`` by default),
AOT autograd would trace a joint forward/backward graph and fail on the
first op without a derivative, so a caller who forgot ``no_grad`` got a
``BackendCompilerFailed`` instead of logits.  Outputs therefore never
require grad; the eager model is unaffected.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.backends.common import aot_autograd
from torch._inductor import config as inductor_config

from cpgraph.ops.providers import bind_providers

from .config import CPConfig
from .graph_facts import PassMatchError
from .invariant_kernels import inductor_options, keep_eager_numerics, run_mode
from .manager import CPPassManager, PassFn
from .pipeline import default_passes
from .recompile_limit import fail_on_recompile_limit


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


def _inductor(options: dict):
    """Inductor as a backend callable with ``options`` (what ``backend="inductor", options=...`` runs)."""

    def run(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=options)

    return run


def _eager_numerics(backend):
    """``backend`` run on the Dynamo graph after :func:`keep_eager_numerics` (deterministic compiles)."""

    def run(gm, example_inputs):
        return backend(keep_eager_numerics(gm), example_inputs)

    return run


def trace_settings() -> contextlib.ExitStack:
    """The Dynamo settings every cpgraph compile traces under (see the module docstring)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
    stack.enter_context(fx_config.patch(use_duck_shape=False))
    stack.enter_context(fail_on_recompile_limit())
    return stack


class CompiledForward:
    """What :func:`compile` returns: calls the ``torch.compile``-d model under :func:`trace_settings`, without grad.

    Attributes other than ``cpgraph_passes`` come from the ``torch.compile``
    result (an ``OptimizedModule`` for a module), so it reads like one.  A
    pass's :class:`~cpgraph.passes.graph_facts.PassMatchError` (a model that
    breaks a contract rule) is raised as itself, not wrapped in Dynamo's
    ``BackendCompilerFailed``.
    """

    def __init__(self, compiled, manager: CPPassManager):
        self._compiled = compiled
        self.cpgraph_passes = manager

    def __call__(self, *args: Any, **kwargs: Any):
        with trace_settings(), torch.no_grad(), run_mode(self.cpgraph_passes.cfg):  # an inference forward
            try:
                return self._compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as failed:
                # A broken model-contract rule is the whole story: raise it as itself, not
                # wrapped in Dynamo's backend-failure report (docs/model_contract.md).
                inner = getattr(failed, "inner_exception", None)
                if isinstance(inner, PassMatchError):
                    raise inner from None
                raise

    def __getattr__(self, name: str):
        if name == "_compiled":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._compiled, name)


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
    returned :class:`CompiledForward` traces under :func:`trace_settings` and
    has a ``cpgraph_passes`` attribute: the pass manager, whose ``history``
    holds op counts before and after each pass.
    """
    if backend == "inductor":
        manager = build_pass_manager(cp, passes, absorbed=inductor_config.post_grad_custom_pre_pass)
        options = {"post_grad_custom_pre_pass": manager, **inductor_options(manager.cfg)}
        if mode == "reduce-overhead":
            options["triton.cudagraphs"] = True
            bind_providers("cuda")  # CUDA graphs: the providers are bound before anything is recorded
        elif mode not in (None, "default"):
            raise ValueError(f"cpgraph.compile: unsupported mode {mode!r} (use None or 'reduce-overhead')")
        if manager.cfg.deterministic:  # norms, sigmoid, ...: ATen's kernels (invariant_kernels.keep_eager_numerics)
            compiled = torch.compile(model, backend=_eager_numerics(_inductor(options)), dynamic=dynamic,
                                     fullgraph=fullgraph)
        else:
            compiled = torch.compile(model, backend="inductor", options=options, dynamic=dynamic, fullgraph=fullgraph)
    elif backend == "aot_eager":
        if mode is not None:
            raise ValueError("cpgraph.compile: mode applies to the inductor backend only")
        manager = build_pass_manager(cp, passes)
        run = aot_eager_with_passes(manager)
        compiled = torch.compile(model, backend=_eager_numerics(run) if manager.cfg.deterministic else run,
                                 dynamic=dynamic, fullgraph=fullgraph)
    else:
        raise ValueError(f"cpgraph.compile: backend must be 'inductor' or 'aot_eager', got {backend!r}")
    return CompiledForward(compiled, manager)

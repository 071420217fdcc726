"""The model the gloo CP tests share, and its compiled forwards, built once per process.

Compiling the model is what those tests spend their time on (seconds of CPU
per graph; a pass without a cached prefix and one with one share a graph,
since ``build_batch`` never gives ``prefix_slots`` 0 or 1 rows), so a rank process builds each compiled
forward once and every test module that runs jobs on the same ranks
(``shared_pool(world, CP_TIMEOUT_S)``) reuses it: ``test_cp_numerics`` and
``test_cache_cp`` share the CP compile of each world size.

The model is GLM-5-style with two layers, the smallest that still has every
kind of layer the CP passes rewrite: layer 0 a dense MLP with its own
indexer, layer 1 a MoE whose top-k comes from layer 0 (IndexCache).  It has
a transformers twin with the same weights (``hf_oracle.make_pair``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))

PAGE = 16
# Gloo timeout of the CP ranks: a rank may sit in a collective while a peer
# compiles a graph, which takes minutes on a loaded 2-core machine.
CP_TIMEOUT_S = 900.0

_BUILT: dict = {}


def model_pair():
    """``(hf, model)``: the two-layer GLM-5-style model and its transformers twin (same weights)."""
    if "pair" not in _BUILT:
        from hf_oracle import config_variants, make_pair

        from cpgraph.models.prefill import make_layout

        config = dict(config_variants()["glm-a"], num_hidden_layers=2)
        hf, model = make_pair(config)
        cfg = model.config
        assert cfg.mlp_layer_types == ("dense", "sparse") and cfg.indexer_types == ("full", "shared")
        model.kv_layout = make_layout(model, "bf16", PAGE)
        _BUILT["pair"] = hf, model
    return _BUILT["pair"]


def use_numerics_compile_settings() -> None:
    """Process-wide compile settings for a rank process of tests that compare numerics, not compiles.

    Call it in a spawned rank (it changes global torch config), before the
    first call of a ``dynamic=True`` compiled model.  ``cpgraph.compile``
    now traces with floats specialized and duck sizing off by itself (per
    call); setting them here too also covers models compiled with plain
    ``torch.compile`` in the same rank.
    """
    import torch.fx.experimental._config

    # Every compile runs the passes (no FX-cache hit from an earlier configuration).
    torch._inductor.config.fx_graph_cache = False
    # The model's floats (norm eps, softmax and index scales) are constants.  Traced as dynamic
    # SymFloats (``dynamic=True``'s default), one of them cannot stay symbolic and Dynamo
    # restarts, tracing every graph twice: half of the compile time, for graphs that compute
    # the same values.
    torch._dynamo.config.specialize_float = True
    # Duck sizing gives dims of equal size one symbol: a rank whose pool happens to have 48 rows
    # (the MLA record width) gets a graph specialized to that pool size and recompiles on the
    # next batch.  Without duck sizing a rank compiles only the graphs its batches need (prefix
    # or not, empty pools on idle ranks).
    torch.fx.experimental._config.use_duck_shape = False
    # The CP and one-device wrappers share the forward's code object and its recompile budget.
    torch._dynamo.config.recompile_limit = 64
    # Inductor on the CPU: scalar C++ kernels.  The CP tests check the graph Inductor lowers (the CP
    # ops and the fusion around them), not the CPU vector code; the C++ compiler takes about 40%
    # less time on scalar kernels (production Inductor on GPUs emits Triton, neither of these).
    torch._inductor.config.cpp.vec_isa_ok = False


def compiled(backend: str, group: str | None = None, cp_size: int = 1):
    """The model compiled with cpgraph's passes (``dynamic=True``), once per process and configuration."""
    key = (backend, group, cp_size)
    if key not in _BUILT:
        from cpgraph.passes import CPConfig, compile

        use_numerics_compile_settings()
        _, model = model_pair()
        cp = CPConfig(group=group, cp_size=cp_size) if cp_size > 1 else CPConfig()
        fn = compile(model, cp, backend=backend, dynamic=True)

        def forward(ids, meta, mla, index, **kw):
            return fn(ids, meta, mla, index, **kw)

        _BUILT[key] = forward
    return _BUILT[key]


def compiled_cp(ctx, backend: str):
    """This rank's CP-compiled forward (``ctx``: the job's :class:`dist_utils.RankContext`)."""
    return compiled(backend, ctx.group_name, ctx.world_size)


def eager_forward():
    _, model = model_pair()

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    return forward

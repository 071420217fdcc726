"""Ops a deterministic compile keeps out of Inductor's code generation: norms and transcendental functions.

``cpgraph::invariant_rms_norm`` / ``invariant_layer_norm`` (the norms) and
``cpgraph::eager_unary`` (``sigmoid``, ``silu``, ``exp``, ``sin``, ``cos``, ...).

Why: a norm is a reduction along one row, row-invariant in ATen's kernels
(one loop per row on CPU; on CUDA one block per row, configured by the row
length), which is what an eager forward runs.  Inductor instead generates
its own reduction kernel per compiled graph, and the per-row reduction
order of that kernel follows its launch config (rows per program, warps,
the reduction block), which Inductor derives from the graph's size hints:
two graphs of one forward (a batch of one request, a batch of four; cp = 1
and cp = 2) get different configs, and a row's norm differs in its last
bits (measured on an H200 with torch 2.11, docs/deterministic.md).  In a
deterministic compile the norms therefore become these ops, which
Inductor cannot lower: they run ATen's own kernel, the one eager runs, in
every graph.  The cost is the fusion Inductor would have done around a
norm (one more read of the row), small next to the products.

Transcendental functions are row-invariant in any kernel (one element, one
instruction sequence), but Inductor's are not ATen's: ``tl.sigmoid`` and
Triton's ``sin`` / ``cos`` round differently from the CUDA math library
eager calls (and Inductor's C++ from ATen's vectorised CPU kernels), so a
compiled forward would differ from eager in the mode.  ``eager_unary``
runs the ATen function itself -- inside the deterministic mode, the mode's
CPU ``sigmoid`` / ``silu`` (``invariant_mode``).  Its cost is the fusion
around it: one more write and read of its input's size.

Same arguments and result as ``F.rms_norm`` / ``F.layer_norm`` (any
normalized shape; the output is a new tensor).  The fake rule runs the same
function on fake tensors: shape and dtype arithmetic only.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ledger


@torch.library.custom_op("cpgraph::invariant_rms_norm", mutates_args=())
def invariant_rms_norm(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
                       eps: Optional[float] = None) -> Tensor:
    """``F.rms_norm(x, normalized_shape, weight, eps)`` by ATen's kernel (module docstring)."""
    ledger.ran_as("invariant_rms_norm", x.device.type, "aten")
    return F.rms_norm(x, list(normalized_shape), weight, eps)


@invariant_rms_norm.register_fake
def _invariant_rms_norm_fake(x, normalized_shape, weight=None, eps=None):
    return F.rms_norm(x, list(normalized_shape), weight, eps)


@torch.library.custom_op("cpgraph::invariant_layer_norm", mutates_args=())
def invariant_layer_norm(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` by ATen's kernel (module docstring)."""
    ledger.ran_as("invariant_layer_norm", x.device.type, "aten")
    return F.layer_norm(x, list(normalized_shape), weight, bias, eps)


@invariant_layer_norm.register_fake
def _invariant_layer_norm_fake(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(x, list(normalized_shape), weight, bias, eps)


# eager_unary's functions: name -> the ATen-backed callable.
UNARY = {
    "sigmoid": torch.sigmoid, "silu": F.silu, "exp": torch.exp, "log": torch.log, "sin": torch.sin, "cos": torch.cos,
    "tanh": torch.tanh, "erf": torch.erf, "rsqrt": torch.rsqrt, "gelu": F.gelu, "softplus": F.softplus,
}


def _unary(x: Tensor, fn: str) -> Tensor:
    if fn not in UNARY:
        raise ValueError(f"eager_unary: unknown function {fn!r} (known: {', '.join(sorted(UNARY))})")
    return UNARY[fn](x)


@torch.library.custom_op("cpgraph::eager_unary", mutates_args=())
def eager_unary(x: Tensor, fn: str) -> Tensor:
    """``fn(x)`` by the ATen kernel eager runs (module docstring); ``fn`` one of :data:`UNARY`."""
    ledger.ran_as("eager_unary", x.device.type, "aten")
    return _unary(x, fn)


@eager_unary.register_fake
def _eager_unary_fake(x, fn):
    return _unary(x, fn)


# torch-level callables a Dynamo graph holds for a norm -> (the cpgraph op that keeps it opaque, its parameters in
# order, their defaults where the op has one).
_RMS = ("invariant_rms_norm", ("input", "normalized_shape", "weight", "eps"), {})
_LAYER = ("invariant_layer_norm", ("input", "normalized_shape", "weight", "bias", "eps"), {"eps": 1e-5})
NORMS = {F.rms_norm: _RMS, torch.rms_norm: _RMS, F.layer_norm: _LAYER, torch.layer_norm: _LAYER}
# torch-level callables (and Tensor method names) of one tensor argument -> eager_unary's function name.
UNARY_CALLS = {fn: name for name, fn in UNARY.items()}
UNARY_METHODS = {name: name for name in UNARY if hasattr(torch.Tensor, name)}

__all__ = ["NORMS", "UNARY", "UNARY_CALLS", "UNARY_METHODS", "eager_unary", "invariant_layer_norm",
           "invariant_rms_norm"]

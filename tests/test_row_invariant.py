"""The fixed-order products of ``tests/row_invariant.py`` and the claim the bit-exact tests rest on.

The ``bitexact`` tests compare runs that compute the same rows in tensors of
other row counts.  That holds by construction only if every op the forward
runs gives a row bits that depend on that row alone (docs/bitwise.md).  Here:
the replaced ops are accurate (close to the exact result) and row- and
position-invariant at this process's thread count, and every aten op a tiny
forward runs -- target with a cached prefix, MTP draft, MoE, indexer, sparse
attention, inside the cpgraph ops too -- is one the argument covers.  An op
outside the list (say ``gelu(approximate="tanh")``, whose CPU kernel rounds its
vector body and its scalar tail differently) fails the last test until it is
classified, or replaced in ``row_invariant.py``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
from row_invariant import products_computed, row_invariant_matmul  # noqa: E402

pytestmark = pytest.mark.bitexact  # runs inside row_invariant_matmul(), re-run by CI at 4 and 1 threads


def _gen(seed):
    return torch.Generator().manual_seed(seed)


SPANS = [(0, 1), (0, 2), (3, 10), (5, 33), (1, 99), (0, 100)]  # row ranges of other sizes and offsets


def _rows_invariant(f, x, dim=0):
    """``f`` on each span of ``x``'s rows equals those rows of ``f(x)``, bit for bit."""
    full = f(x)
    return all(torch.equal(f(x.narrow(dim, a, b - a).clone()), full.narrow(dim, a, b - a)) for a, b in SPANS)


def _exact(f, *tensors):
    """``f`` on float64 copies through numpy (no torch kernel involved): the products' exact reference."""
    out = f(*(t.double().numpy() for t in tensors))
    return torch.from_numpy(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_accurate_and_row_invariant(dtype):
    g = _gen(0)
    x = torch.randn(100, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    e = torch.randn(3, 48, 24, generator=g).to(dtype)
    before = products_computed()
    got = {"mm": x @ w.t(), "addmm": F.linear(x, w, b), "bmm": torch.einsum("mk,ekn->emn", x, e)}
    assert products_computed() - before == 3  # each product ran here, not in the BLAS
    want = {
        "mm": _exact(lambda a, c: a @ c.T, x, w),
        "addmm": _exact(lambda a, c, d: a @ c.T + d, x, w, b),
        "bmm": _exact(lambda a, c: (a[None] @ c), x, e),
    }
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    for name in want:
        assert got[name].dtype == dtype and got[name].shape == want[name].shape
        torch.testing.assert_close(got[name].double(), want[name], **tol)
    assert _rows_invariant(lambda t: t @ w.t(), x)
    assert _rows_invariant(lambda t: F.linear(t, w, b), x)
    assert _rows_invariant(lambda t: torch.einsum("mk,ekn->emn", t, e).transpose(0, 1), x)
    # Attention-shaped batched products: the batch is the row dimension.
    q = torch.randn(100, 4, 16, generator=g).to(dtype)
    k = torch.randn(9, 16, generator=g).to(dtype)
    assert _rows_invariant(lambda t: torch.einsum("rhd,rkd->rhk", t, k.expand(t.shape[0], -1, -1)), q)


def test_sigmoid_and_silu_are_position_invariant_and_accurate():
    x = torch.randn(20_000, generator=_gen(1)) * 4
    got = torch.sigmoid(x), F.silu(x)
    want = _exact(lambda a: 1 / (1 + np.exp(-a)), x), _exact(lambda a: a / (1 + np.exp(-a)), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-7)
    for f in (torch.sigmoid, F.silu):
        assert _rows_invariant(f, x)
    y = x.clone()
    torch.sigmoid_(y)
    assert torch.equal(y, got[0])


# Every aten op a forward may run, by why a row's result cannot depend on the other rows (docs/bitwise.md).
MOVES = {  # data movement, creation, shape: no arithmetic
    "_to_copy", "_unsafe_view", "alias", "arange", "as_strided", "cat", "clone", "constant_pad_nd", "copy_",
    "detach", "embedding", "empty", "empty_like", "empty_strided", "expand", "fill_", "full", "full_like",
    "gather", "index", "index_put_", "index_select", "lift_fresh", "masked_fill", "masked_fill_", "narrow",
    "new_empty", "new_zeros", "ones", "ones_like", "permute", "repeat", "repeat_interleave", "reshape",
    "scatter", "scatter_", "select", "slice", "split", "split_with_sizes", "squeeze", "stack", "t",
    "transpose", "unbind", "unsqueeze", "view", "where", "zero_", "zeros", "zeros_like", "_local_scalar_dense",
    "flip", "roll", "contiguous", "unfold", "bitwise_and", "bitwise_or", "bitwise_not", "logical_and",
    "logical_or", "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "isinf", "isnan", "isfinite", "isneginf",
    "isposinf", "sort", "argsort", "topk", "max", "min", "amax", "amin", "maximum", "minimum", "clamp",
    "clamp_min", "clamp_max", "clamp_min_", "relu", "relu_", "abs", "neg", "sign", "floor", "ceil", "round",
    "trunc", "remainder", "floor_divide", "any", "all", "view_as", "unflatten", "flatten", "new_full",
    "scatter_add", "scatter_add_",
    "argmax", "argmin", "bitwise_xor", "__lshift__", "__rshift__", "bitwise_left_shift", "bitwise_right_shift",
}
IEEE = {  # one correctly rounded operation per element (vector lanes and scalar tail agree)
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "sqrt", "rsqrt", "reciprocal",
}
ONE_FORMULA = {  # one vector routine for every lane, partial vectors included
    "exp", "exp_", "log", "log_", "sin", "cos", "tanh",
}
ROW_REDUCTIONS = {  # reduce along a row of fixed length: each output by the same loop on its own row
    "sum", "mean", "native_layer_norm", "_softmax", "_log_softmax", "logsumexp",
}
REPLACED = {"mm", "addmm", "bmm", "baddbmm", "sigmoid", "sigmoid_", "silu", "silu_"}  # row_invariant.py
POW_EXPONENTS = {2, 2.0, 0.5, -0.5, 1, 1.0, -1, -1.0}  # computed as x*x, sqrt, rsqrt, x, 1/x


class _AtenOps(TorchDispatchMode):
    """Records every aten op, inside cpgraph's custom ops too (their bodies run with the mode pushed again)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()
        self.pow_exponents: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # what it decomposes into (inside a custom op's kernel, composites reach the mode whole)
                return func.decompose(*args, **kwargs)
        if ns == "aten":
            name = func.__name__.split(".")[0]
            self.seen[name] += 1
            if name == "pow":
                self.pow_exponents.add(args[1] if not isinstance(args[1], torch.Tensor) else "tensor")
            return func(*args, **kwargs)
        with self:  # the custom op's CPU kernel, whose aten ops come back through this mode
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)


def _classified(name: str) -> bool:
    return name == "pow" or any(name in group for group in (MOVES, IEEE, ONE_FORMULA, ROW_REDUCTIONS, REPLACED))


def _record(run) -> _AtenOps:
    mode = _AtenOps()
    with torch.no_grad(), mode:
        run()
    return mode


def test_every_op_of_a_forward_is_covered():
    """Target (dense + MoE, cached prefix), MTP draft: each aten op they run is in one of the classes above."""
    import mtp_reference as ref

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill

    glm = from_pretrained("tiny-glm5").eval()
    glm.kv_layout = make_layout(glm, "bf16", 16)
    mtp = ref.build()
    g = _gen(3)
    glm_prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 17, 33)]
    mtp_prompts = [torch.randint(0, ref.CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (40, 9)]

    def run():
        run_prefill(lambda *a, **k: glm(*a, **k), glm, glm_prompts, prefix_lens=[16, 0, 16], page_size=16)
        run_prefill(lambda *a, **k: mtp(*a, **k), mtp, mtp_prompts, prefix_lens=[16, 0], page_size=ref.PAGE,
                    draft=mtp.draft_module())

    mode = _record(run)
    print(f"\naten ops of the forward: {dict(sorted(mode.seen.items()))}")
    assert {"mm", "bmm", "sigmoid", "silu", "topk", "logsumexp"} <= set(mode.seen)  # it saw the whole forward
    unknown = sorted(n for n in mode.seen if not _classified(n))
    assert not unknown, f"aten ops not shown row-invariant (docs/bitwise.md): {unknown}"
    assert mode.pow_exponents <= POW_EXPONENTS, mode.pow_exponents
    assert not _classified("gelu") and not _classified("softplus") and not _classified("exp2")  # the list is a list


def test_the_classes_hold_here():
    """Spot checks of the classes on this machine and thread count: other row counts, other offsets, same bits."""
    g = _gen(4)
    x = torch.randn(100, 37, generator=g) * 3
    checks = [torch.exp, lambda t: torch.log(t.abs() + 0.5), torch.sin, torch.cos, torch.tanh,
              lambda t: torch.rsqrt(t.abs() + 0.5), lambda t: t.pow(2), lambda t: t.mean(-1), lambda t: t.sum(-1),
              lambda t: t.softmax(-1), lambda t: t.logsumexp(-1), lambda t: F.layer_norm(t, (37,)),
              lambda t: t.topk(5, dim=-1).values]
    for f in checks:
        assert _rows_invariant(f, x)

def test_a_block_without_products_is_an_error():
    """A rank job whose forward bypassed the replaced kernels must not pass as 'bit-exact by construction'."""
    with pytest.raises(AssertionError, match="no matrix product ran"):
        with row_invariant_matmul():
            torch.ones(3).sum()
    before = products_computed()
    torch.ones(2, 3) @ torch.ones(3, 4)  # the test's own (outer) block is still in force
    assert products_computed() == before + 1

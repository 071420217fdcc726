"""Row movement ops: gather rows, compact valid rows around MoE, restore the layout.

Why ops and not plain indexing: the CP passes must find these steps in the
graph by name (to fuse, to reorder, to check that dummy rows never reach the
router), and Triton providers replace them on GPU.  All shapes follow from
input shapes; ``-1`` indices produce zero rows instead of a data-dependent
shape.  Padding provenance is described in ``docs/contracts.md``.

Index rule shared by every row and paged op (references and kernels alike):
an index entry names a row iff ``0 <= i < n``; every other value (``-1``,
any other negative, ``>= n``, anything into an empty tensor) means "no
row", exactly like ``-1``.  Why not an error: checking values needs a host
sync, and an out-of-range id must never become an out-of-bounds memory
access, so without ``CPGRAPH_DEBUG`` the op has to do *something* defined
and identical on every provider; with the flag the op bodies raise instead.
See ``docs/ops/paged.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor
from .providers import select

_INDEX = (torch.int64, torch.int32)


# ------------------------------------------------------------------ take_rows
def _check_take_rows(x: Tensor, index: Tensor) -> None:
    check_tensor("take_rows", "x", x)
    if x.dim() < 1:
        raise ValueError("cpgraph.take_rows: argument 'x' must have at least 1 dimension")
    check_tensor("take_rows", "index", index, dtype=_INDEX, ndim=1)
    check_same_device("take_rows", x=x, index=index)


def index_in_range(index: Tensor, n) -> tuple[Tensor, Tensor]:
    """``(valid, safe)`` for an index into ``n`` rows: ``valid = 0 <= index < n``, ``safe`` = index or 0.

    The one place the references apply the index rule (module docstring):
    ``safe`` is always a legal row when ``n > 0``, so the torch kernels that
    follow never see an out-of-range id either.
    """
    idx = index.to(torch.int64)
    valid = (idx >= 0) & (idx < n)
    return valid, torch.where(valid, idx, torch.zeros((), dtype=torch.int64, device=idx.device))


def take_rows_reference(x: Tensor, index: Tensor) -> Tensor:
    if x.shape[0] == 0:  # nothing to read: every index means "no row"
        return x.new_zeros((index.shape[0], *x.shape[1:]))
    valid, safe = index_in_range(index, x.shape[0])
    rows = x.index_select(0, safe)
    mask = valid.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=x.dtype, device=x.device))


@torch.library.custom_op("cpgraph::take_rows", mutates_args=())
def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """``out[k] = x[index[k]]``, or zeros where ``index[k] == -1``.

    ``x``: ``[N, ...]`` any dtype; ``index``: int32/int64 ``[K]`` with values in
    ``[-1, N)``.  Returns ``[K, ...]``, a new tensor.  An entry outside
    ``[0, N)`` (below ``-1`` or ``>= N`` included) gives a zero row like
    ``-1``; with ``CPGRAPH_DEBUG`` on, anything outside ``[-1, N)`` raises.
    """
    _check_take_rows(x, index)
    check_index_range("take_rows", "index", index, -1, x.shape[0])
    return select("take_rows", x.device.type, take_rows_reference)(x, index)


@take_rows.register_fake
def _take_rows_fake(x, index):
    _check_take_rows(x, index)
    return x.new_empty((index.shape[0], *x.shape[1:]))


# ------------------------------------------------- compact_valid / restore_compute
def compact_valid_reference(x: Tensor, valid_rows: Tensor) -> Tensor:
    return take_rows_reference(x, valid_rows)


@torch.library.custom_op("cpgraph::compact_valid", mutates_args=())
def compact_valid(x: Tensor, valid_rows: Tensor) -> Tensor:
    """Keep only valid rows: ``out = x[valid_rows]`` (``[V, ...]``).

    Placed before the MoE router so that CP compute padding and static
    padding rows never take part in routing.  ``valid_rows`` comes from the
    plan (its length is known when the batch is planned, never from data)
    and should lie in ``[0, N)``.  An entry outside it (``-1`` included)
    gives a zero row, as in ``take_rows``; with ``CPGRAPH_DEBUG`` on it
    raises (a valid-row list never names "no row").
    """
    _check_take_rows(x, valid_rows)
    check_index_range("compact_valid", "valid_rows", valid_rows, 0, x.shape[0])
    return select("compact_valid", x.device.type, compact_valid_reference)(x, valid_rows)


@compact_valid.register_fake
def _compact_valid_fake(x, valid_rows):
    _check_take_rows(x, valid_rows)
    return x.new_empty((valid_rows.shape[0], *x.shape[1:]))


def restore_compute_reference(y: Tensor, valid_rows: Tensor, num_rows: int) -> Tensor:
    # Rows whose target is out of range land in one extra sentinel row, dropped at the end.
    valid, safe = index_in_range(valid_rows, num_rows)
    target = torch.where(valid, safe, torch.full((), num_rows, dtype=torch.int64, device=safe.device))
    out = y.new_zeros((num_rows + 1, *y.shape[1:]))
    out.index_copy_(0, target, y)
    return out[:num_rows].clone()


def _check_restore(y: Tensor, valid_rows: Tensor, num_rows) -> None:
    check_tensor("restore_compute", "y", y)
    if y.dim() < 1:
        raise ValueError("cpgraph.restore_compute: argument 'y' must have at least 1 dimension")
    check_tensor("restore_compute", "valid_rows", valid_rows, dtype=_INDEX, ndim=1, shape=(y.shape[0],))
    check_same_device("restore_compute", y=y, valid_rows=valid_rows)


@torch.library.custom_op("cpgraph::restore_compute", mutates_args=())
def restore_compute(y: Tensor, valid_rows: Tensor, num_rows: int) -> Tensor:
    """Inverse of ``compact_valid``: ``out[valid_rows] = y``, every other row exact zero.

    Returns ``[num_rows, ...]`` in the compute layout, so collectives after
    the MoE keep their uniform per-rank shapes.  A ``y`` row whose
    ``valid_rows`` entry lies outside ``[0, num_rows)`` is dropped (the index
    rule of this module); with ``CPGRAPH_DEBUG`` on it raises.
    """
    _check_restore(y, valid_rows, num_rows)
    check_index_range("restore_compute", "valid_rows", valid_rows, 0, num_rows)
    return select("restore_compute", y.device.type, restore_compute_reference)(y, valid_rows, num_rows)


@restore_compute.register_fake
def _restore_compute_fake(y, valid_rows, num_rows):
    _check_restore(y, valid_rows, num_rows)
    return y.new_empty((num_rows, *y.shape[1:]))


# --------------------------------------------------- static-shape (CUDA graph) form
def _check_static(op: str, x: Tensor, row_kind: Tensor) -> None:
    check_tensor(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"cpgraph.{op}: argument 'x' must have at least 1 dimension")
    check_tensor(op, "row_kind", row_kind, dtype=_INDEX, ndim=1, shape=(x.shape[0],))
    check_same_device(op, x=x, row_kind=row_kind)


def _valid_first_permutation(row_kind: Tensor) -> Tensor:
    # Stable sort on "is dummy": valid rows keep their order and move to the front.
    return torch.sort((row_kind != 0).to(torch.int8), stable=True).indices


def compact_valid_static_reference(x: Tensor, row_kind: Tensor) -> tuple[Tensor, Tensor]:
    perm = _valid_first_permutation(row_kind)
    num_valid = (row_kind == 0).sum().reshape(1).to(torch.int64)
    keep = (torch.arange(x.shape[0], device=x.device) < num_valid).view(-1, *([1] * (x.dim() - 1)))
    y = torch.where(keep, x.index_select(0, perm), torch.zeros((), dtype=x.dtype, device=x.device))
    return y, num_valid


@torch.library.custom_op("cpgraph::compact_valid_static", mutates_args=())
def compact_valid_static(x: Tensor, row_kind: Tensor) -> tuple[Tensor, Tensor]:
    """Static-shape compaction: valid rows (``row_kind == 0``) permuted to a prefix.

    Returns ``(y[M, ...], num_valid int64[1])``: ``y[:num_valid]`` are the
    valid rows in order, the rest are exact zeros.  Shapes never depend on
    data, so the op is CUDA-graph capturable across batches of one bucket;
    ``num_valid`` stays on the device for kernels that can bound their work.
    """
    _check_static("compact_valid_static", x, row_kind)
    return select("compact_valid_static", x.device.type, compact_valid_static_reference)(x, row_kind)


@compact_valid_static.register_fake
def _compact_valid_static_fake(x, row_kind):
    _check_static("compact_valid_static", x, row_kind)
    return x.new_empty(x.shape), row_kind.new_empty((1,), dtype=torch.int64)


def restore_compute_static_reference(y: Tensor, row_kind: Tensor) -> Tensor:
    perm = _valid_first_permutation(row_kind)
    inverse = torch.empty_like(perm)
    inverse.index_copy_(0, perm, torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype))
    valid = (row_kind == 0).view(-1, *([1] * (y.dim() - 1)))
    return torch.where(valid, y.index_select(0, inverse), torch.zeros((), dtype=y.dtype, device=y.device))


@torch.library.custom_op("cpgraph::restore_compute_static", mutates_args=())
def restore_compute_static(y: Tensor, row_kind: Tensor) -> Tensor:
    """Inverse of ``compact_valid_static``: back to the compute layout, dummy rows exact zeros."""
    _check_static("restore_compute_static", y, row_kind)
    return select("restore_compute_static", y.device.type, restore_compute_static_reference)(y, row_kind)


@restore_compute_static.register_fake
def _restore_compute_static_fake(y, row_kind):
    _check_static("restore_compute_static", y, row_kind)
    return y.new_empty(y.shape)

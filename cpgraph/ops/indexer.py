"""Lightning-indexer ops: scores, FP8 scoring, Hadamard, top-k in two coordinate spaces.

The indexer picks, for every query row, the ``topk`` keys that sparse MLA will
attend to.  Its score is ``sum_h w[s,h] * relu(q[s,h] . k[t])`` over the row's
causal window ``[ks, ke)`` of the flattened ragged full view (see
``cpgraph.plan``: ``ke = ks + position + 1``; dummy rows have ``ks == ke``).
All scale factors (``H^-0.5 * D^-0.5``, the FP8 q scale) are folded into the
per-head weights by the caller, because the production kernel (DeepGEMM
``fp8_mqa_logits``) takes weights but no separate scales for q.

Why the ops are split the way they are:

* ``indexer_logits`` (fp32) is the oracle form, comparable with the
  transformers DeepSeek-V3.2 indexer; ``indexer_q_quant`` +
  ``indexer_logits_fp8`` are the production form (e4m3 bytes, power-of-two
  scales), so a provider can bind the FP8 kernel without changing the graph.
* top-k has two outputs spaces.  RAGGED ids index the flattened full view
  (already offset by the request start), which is what the materialised KV
  buffer uses; PAGED ids are physical KV slots (``kv_slots[t]``), which is
  what a kernel reading the paged pool uses.  They differ as soon as a batch
  holds more than one request or pages are not allocated in order, so they
  are separate ops instead of a flag nobody tests.
* ``indexer_topk`` fuses scores and selection in row chunks: the ``[M, N]``
  fp32 score matrix of a long prefill does not fit in memory (128K x 128K x 4
  bytes = 64 GiB), while a chunk of rows does.  The chunk size depends only on
  shapes and the byte budget, never on data, so it is the same on every rank
  and under every compile.  Given ``k_scale`` it takes the FP8 operands of
  ``indexer_logits_fp8`` instead, so the production FP8 path is chunked the
  same way; it stays one op (rather than a second fused op) because the graph
  passes already know ``indexer_topk``'s window and key arguments by position.
* Every top-k (and every provider of one) follows one tie rule: equal scores
  go to the lower logical position (:func:`tie_rank_keys`,
  docs/ops/indexer.md).  Few-head indexers tie exactly and often, and an
  arbitrary tie-break changes which keys later layers attend to.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor, debug_enabled
from .codecs import pow2_scale
from .providers import select

_INDEX = (torch.int64, torch.int32)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
E4M3_MAX = 448.0
QUANT_BLOCK = 128  # values covered by one ue8m0 scale
_HEAD_GROUP = 8  # heads scored together in the reference (bounds the transient)


# ---------------------------------------------------------------- shared checks
def _check_window(op: str, m, ks: Tensor, ke: Tensor) -> None:
    check_tensor(op, "ks", ks, dtype=_INDEX, ndim=1, shape=(m,))
    check_tensor(op, "ke", ke, dtype=_INDEX, ndim=1, shape=(m,))


def _check_window_values(op: str, ks: Tensor, ke: Tensor, num_keys) -> None:
    """Debug-only value checks: ``0 <= ks <= ke <= N``."""
    if not debug_enabled():
        return
    check_index_range(op, "ks", ks, 0, num_keys + 1)
    check_index_range(op, "ke", ke, 0, num_keys + 1)
    check_index_range(op, "ke - ks", ke - ks, 0, num_keys + 1)


def _check_key_scales(op: str, k_scale: Tensor) -> None:
    """Debug-only: key scales are positive (the providers apply them after the ReLU, exact only then)."""
    if debug_enabled() and not bool((k_scale > 0).all()):  # sync-ok (debug)
        raise ValueError(f"cpgraph.{op}: argument 'k_scale' must be positive (ue8m0 powers of two)")


def _check_topk_arg(op: str, topk) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"cpgraph.{op}: argument 'topk' must be an int >= 1, got {topk!r}")


def _check_scoring(op: str, q: Tensor, k: Tensor, weights: Tensor, ks: Tensor, ke: Tensor) -> None:
    check_tensor(op, "q", q, dtype=_FLOAT, ndim=3)
    m, h, d = q.shape
    check_tensor(op, "k", k, dtype=_FLOAT, ndim=2, shape=(None, d))
    check_tensor(op, "weights", weights, dtype=torch.float32, ndim=2, shape=(m, h))
    _check_window(op, m, ks, ke)
    check_same_device(op, q=q, k=k, weights=weights, ks=ks, ke=ke)


# ------------------------------------------------------------ scoring kernels
def _window_mask(ks: Tensor, ke: Tensor, num_keys: int) -> Tensor:
    """``[M, N]`` bool: key column ``t`` lies in row ``s``'s window ``[ks, ke)``."""
    cols = torch.arange(num_keys, device=ks.device)
    return (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])


def _masked_logits(q: Tensor, k: Tensor, weights: Tensor, ks: Tensor, ke: Tensor) -> Tensor:
    """fp32 ``[M, N]`` window-masked scores; ``q``/``k`` are already real-valued.

    Heads are accumulated a group at a time, so the transient is
    ``[M, group, N]`` rather than ``[M, H, N]``.
    """
    m, h, _ = q.shape
    n = k.shape[0]
    qf = q.float()
    kt = k.float().t()
    out = torch.zeros((m, n), dtype=torch.float32, device=q.device)
    for h0 in range(0, h, _HEAD_GROUP):
        h1 = min(h, h0 + _HEAD_GROUP)
        dots = torch.matmul(qf[:, h0:h1, :], kt)  # [M, g, N]
        dots.relu_()
        out += torch.einsum("mg,mgn->mn", weights[:, h0:h1], dots)
    return out.masked_fill_(~_window_mask(ks, ke, n), float("-inf"))


_NO_KEY = torch.iinfo(torch.int64).min  # rank key of a column outside the window
_LOW32 = 0xFFFFFFFF


def tie_rank_keys(logits: Tensor, ks: Tensor, ke: Tensor) -> Tensor:
    """int64 ``[M, N]`` keys whose descending order is the top-k order under the tie rule.

    The rule (docs/ops/indexer.md, "Tie rule"): higher score first; among
    equal scores the lower column wins (in a row's window the column order
    is the keys' logical order in the request).  ``-0.0`` equals ``0.0``;
    every NaN equals every other NaN and ranks above ``+inf`` (as in
    ``torch.sort``).  A score's fp32 bits are mapped to an order-preserving
    signed int32 ``o`` and the key is ``o * 2^32 + (2^32 - 1 - t)``: all keys
    of a window are distinct, so any exact top-k of them (no stability
    needed) picks the same set in the same order.  Columns outside the window
    get ``int64 min``, below every in-window key (even a ``-inf`` score).
    """
    x = logits.float()
    x = torch.where(x == 0, torch.zeros((), device=x.device), x)  # -0.0 -> +0.0
    x = torch.where(torch.isnan(x), torch.full((), float("nan"), device=x.device), x)  # one NaN bit pattern
    bits = x.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    cols = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
    keys = (ordered << 32) | (_LOW32 - cols)
    inside = _window_mask(ks, ke, logits.shape[1])
    return torch.where(inside, keys, torch.full((), _NO_KEY, dtype=torch.int64, device=keys.device))


def _select_topk(logits: Tensor, ks: Tensor, ke: Tensor, topk: int) -> Tensor:
    """int32 ``[M, topk]`` ragged ids of the best in-window keys under the tie rule, in position order, ``-1`` padded.

    The window is applied again here (``logits`` may come from a kernel that
    writes garbage outside it).  Keys are padded with the out-of-window key up
    to ``topk`` so ``torch.topk`` is defined for short views; any pick outside
    the window becomes ``-1`` (at the tail: every in-window key ranks above
    the padding).  The transient is an int64 ``[M, N]``
    (twice the fp32 logits it ranks).
    """
    n = logits.shape[1]
    keys = tie_rank_keys(logits, ks, ke)
    if n < topk:
        keys = F.pad(keys, (0, topk - n), value=_NO_KEY)
    idx = keys.topk(topk, dim=1, largest=True, sorted=False).indices
    keep = (idx >= ks[:, None]) & (idx < ke[:, None])
    # Position order, padding last: the set is the tie rule's, the order carries no score information
    # (sparse attention is order-free, and ascending positions read the KV in address order).
    past = torch.full((), max(n, topk), dtype=idx.dtype, device=idx.device)
    idx = torch.where(keep, idx, past).sort(dim=1).values
    return torch.where(idx < n, idx, torch.full((), -1, dtype=idx.dtype, device=idx.device)).to(torch.int32)


# ---------------------------------------------------------------- indexer_logits
def indexer_logits_reference(q, k, weights, ks, ke):
    return _masked_logits(q, k, weights, ks, ke)


@torch.library.custom_op("cpgraph::indexer_logits", mutates_args=())
def indexer_logits(q: Tensor, k: Tensor, weights: Tensor, ks: Tensor, ke: Tensor) -> Tensor:
    """fp32 ``[M, N]``: ``sum_h weights[s,h] * relu(q[s,h] . k[t])`` for ``ks[s] <= t < ke[s]``, else ``-inf``.

    ``q`` ``[M, H, D]`` and ``k`` ``[N, D]`` are float (any of fp32/bf16/fp16,
    computed in fp32); ``weights`` fp32 ``[M, H]`` carries every scale;
    ``ks``/``ke`` int32/int64 ``[M]`` with ``0 <= ks <= ke <= N``.
    """
    _check_scoring("indexer_logits", q, k, weights, ks, ke)
    _check_window_values("indexer_logits", ks, ke, k.shape[0])
    return select("indexer_logits", q.device.type, indexer_logits_reference)(q, k, weights, ks, ke)


@indexer_logits.register_fake
def _indexer_logits_fake(q, k, weights, ks, ke):
    _check_scoring("indexer_logits", q, k, weights, ks, ke)
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


# ------------------------------------------------------------- indexer_q_quant
def _check_q_quant(q: Tensor, weights: Tensor, op: str = "indexer_q_quant") -> None:
    check_tensor(op, "q", q, dtype=_FLOAT, ndim=3)
    m, h, d = q.shape
    if isinstance(d, int) and d > QUANT_BLOCK:
        raise ValueError(
            f"cpgraph.{op}: argument 'q' head dim must be <= {QUANT_BLOCK} (one ue8m0 scale per "
            f"head row can be folded into the weights, several cannot), got shape {tuple(q.shape)}"
        )
    check_tensor(op, "weights", weights, dtype=torch.float32, ndim=2, shape=(m, h))
    check_same_device(op, q=q, weights=weights)


def ue8m0_scale(amax: Tensor) -> Tensor:
    """Power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` (fp32), computed exactly.

    A power of two is exact to divide by and is what the ue8m0 scale format
    of the production kernels can represent.  The exponent comes from the
    bits (:func:`cpgraph.ops.codecs.pow2_scale`, the index-K codec's rule),
    not from ``torch.log2``: an fp32 log2 rounds ``k + tiny`` to ``k`` for an
    fp32 amax a few ulps above ``448 * 2**k``, which gave a scale one power of
    two too small (the row's largest values clamped at 448), and its last bit
    may differ between devices.  A non-finite amax is its own scale (``inf``
    or NaN), as ``exp2(ceil(log2(.)))`` gives.
    """
    amax = amax.float()
    return torch.where(torch.isfinite(amax), pow2_scale(amax), amax)


def e4m3_bytes(x: Tensor, scale: Tensor) -> Tensor:
    """uint8 e4m3 bytes of ``x / scale`` (``scale`` broadcast over the last dim)."""
    y = (x.float() / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def indexer_q_quant_reference(q, weights):
    scale = ue8m0_scale(q.float().abs().amax(dim=-1))  # [M, H]
    return e4m3_bytes(q, scale), weights * scale


@torch.library.custom_op("cpgraph::indexer_q_quant", mutates_args=())
def indexer_q_quant(q: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise indexer queries to e4m3 and fold each head row's scale into the weights.

    Returns ``(q_bytes uint8 [M, H, D], weights * q_scale fp32 [M, H])`` with
    ``q_scale = 2^ceil(log2(max(amax_row, 1e-4) / 448))`` per ``(s, h)`` row
    (``D <= 128``: one 128-value block, exactly the production layout).  The
    fold is exact because ``relu(c * x) = c * relu(x)`` for ``c > 0``.
    """
    _check_q_quant(q, weights)
    return select("indexer_q_quant", q.device.type, indexer_q_quant_reference)(q, weights)


@indexer_q_quant.register_fake
def _indexer_q_quant_fake(q, weights):
    _check_q_quant(q, weights)
    return q.new_empty(q.shape, dtype=torch.uint8), weights.new_empty(weights.shape)


# ----------------------------------------------------------- indexer_logits_fp8
def _check_fp8_scoring(op, q_name, k_name, q, k, k_scale, weights, ks, ke) -> None:
    """FP8 scoring inputs (e4m3 bytes + per-key scales), under each op's own argument names."""
    check_tensor(op, q_name, q, dtype=torch.uint8, ndim=3)
    m, h, d = q.shape
    check_tensor(op, k_name, k, dtype=torch.uint8, ndim=2, shape=(None, d))
    check_tensor(op, "k_scale", k_scale, dtype=torch.float32, ndim=1, shape=(k.shape[0],))
    check_tensor(op, "weights", weights, dtype=torch.float32, ndim=2, shape=(m, h))
    _check_window(op, m, ks, ke)
    check_same_device(op, **{q_name: q, k_name: k}, k_scale=k_scale, weights=weights, ks=ks, ke=ke)


def _check_logits_fp8(q_bytes, k_bytes, k_scale, weights, ks, ke) -> None:
    _check_fp8_scoring("indexer_logits_fp8", "q_bytes", "k_bytes", q_bytes, k_bytes, k_scale, weights, ks, ke)


def e4m3_decode(b: Tensor) -> Tensor:
    """fp32 values of uint8 e4m3 bytes."""
    return b.view(torch.float8_e4m3fn).float()


def indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, weights, ks, ke):
    keys = e4m3_decode(k_bytes) * k_scale.unsqueeze(-1)
    return _masked_logits(e4m3_decode(q_bytes), keys, weights, ks, ke)


@torch.library.custom_op("cpgraph::indexer_logits_fp8", mutates_args=())
def indexer_logits_fp8(
    q_bytes: Tensor, k_bytes: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor
) -> Tensor:
    """FP8 form of ``indexer_logits`` (the DeepGEMM ``fp8_mqa_logits`` contract).

    ``logits[s,t] = sum_h weights[s,h] * relu(e4m3(q_bytes[s,h]) . e4m3(k_bytes[t]) * k_scale[t])``
    inside ``[ks[s], ke[s])``, ``-inf`` outside.  The q scale is already in
    ``weights`` (see ``indexer_q_quant``); ``k_scale`` is one positive fp32 per
    key row (providers may apply it after the ReLU; checked with ``CPGRAPH_DEBUG=1``).
    """
    _check_logits_fp8(q_bytes, k_bytes, k_scale, weights, ks, ke)
    _check_window_values("indexer_logits_fp8", ks, ke, k_bytes.shape[0])
    _check_key_scales("indexer_logits_fp8", k_scale)
    fn = select("indexer_logits_fp8", q_bytes.device.type, indexer_logits_fp8_reference)
    return fn(q_bytes, k_bytes, k_scale, weights, ks, ke)


@indexer_logits_fp8.register_fake
def _indexer_logits_fp8_fake(q_bytes, k_bytes, k_scale, weights, ks, ke):
    _check_logits_fp8(q_bytes, k_bytes, k_scale, weights, ks, ke)
    return weights.new_empty((q_bytes.shape[0], k_bytes.shape[0]))


# --------------------------------------------------------------------- hadamard
def _check_hadamard(x: Tensor, op: str = "hadamard", name: str = "x") -> None:
    check_tensor(op, name, x, dtype=_FLOAT)
    if x.dim() < 1:
        raise ValueError(f"cpgraph.{op}: argument '{name}' must have at least 1 dimension")
    d = x.shape[-1]
    if isinstance(d, int) and (d < 1 or d & (d - 1)):
        raise ValueError(f"cpgraph.{op}: argument '{name}' last dim must be a power of two, got shape {tuple(x.shape)}")


def hadamard_reference(x):
    d = x.shape[-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:  # butterflies on the Sylvester ordering: H_2n = [[H, H], [H, -H]]
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * (d**-0.5)).to(x.dtype)


def indexer_q_prepare_reference(q, weights):
    return indexer_q_quant_reference(hadamard_reference(q), weights)


@torch.library.custom_op("cpgraph::indexer_q_prepare", mutates_args=())
def indexer_q_prepare(q: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """``indexer_q_quant(hadamard(q), weights)``: the FP8 indexer's queries rotated, quantised and folded in one op.

    Why one op: the rotated queries (``[M, 64, 128]`` in the activation dtype, 512 MB at 32K tokens)
    are read by nothing but the quantiser, so a provider can rotate, round to ``q.dtype`` and quantise
    each row in one pass instead of writing the rotated rows out and reading them back.  Bit-exact
    with the two ops in sequence (the rotation is rounded to ``q.dtype`` before it is quantised, as the
    pair does).
    """
    _check_q_quant(q, weights, "indexer_q_prepare")
    _check_hadamard(q, "indexer_q_prepare", "q")
    return select("indexer_q_prepare", q.device.type, indexer_q_prepare_reference)(q, weights)


@indexer_q_prepare.register_fake
def _indexer_q_prepare_fake(q, weights):
    _check_q_quant(q, weights, "indexer_q_prepare")
    _check_hadamard(q, "indexer_q_prepare", "q")
    return q.new_empty(q.shape, dtype=torch.uint8), weights.new_empty(weights.shape)


@torch.library.custom_op("cpgraph::hadamard", mutates_args=())
def hadamard(x: Tensor) -> Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (``D`` a power of two).

    ``out = x @ H_D / sqrt(D)`` with the Sylvester ``H_D``
    (``H[i,j] = (-1)^popcount(i & j)``), computed in fp32 and cast back.
    Production applies it to indexer q and k before FP8 quantisation: it is
    orthonormal, so ``q . k`` is unchanged, but it spreads outliers across the
    block, which shrinks the ue8m0 scale error.
    """
    _check_hadamard(x)
    return select("hadamard", x.device.type, hadamard_reference)(x)


@hadamard.register_fake
def _hadamard_fake(x):
    _check_hadamard(x)
    return torch.empty_like(x)


# ------------------------------------------------------------------------ top-k
def _check_topk(op: str, logits: Tensor, ks: Tensor, ke: Tensor, topk) -> None:
    check_tensor(op, "logits", logits, dtype=torch.float32, ndim=2)
    _check_window(op, logits.shape[0], ks, ke)
    _check_topk_arg(op, topk)
    check_same_device(op, logits=logits, ks=ks, ke=ke)


def topk_ragged_reference(logits, ks, ke, topk):
    return _select_topk(logits, ks, ke, topk)


@torch.library.custom_op("cpgraph::topk_ragged", mutates_args=())
def topk_ragged(logits: Tensor, ks: Tensor, ke: Tensor, topk: int) -> Tensor:
    """int32 ``[M, topk]``: the best keys of each row's window, in RAGGED coordinates.

    Values are column ids ``t`` of ``logits`` with ``ks[s] <= t < ke[s]``,
    i.e. row ids of the flattened ragged full view, already offset by the
    request start.  Best first; ``-1`` fills the tail when the window holds
    fewer than ``topk`` keys (all ``-1`` for a dummy row, ``ks == ke``).
    Ties are broken arbitrarily (as in ``torch.topk``).
    """
    _check_topk("topk_ragged", logits, ks, ke, topk)
    _check_window_values("topk_ragged", ks, ke, logits.shape[1])
    return select("topk_ragged", logits.device.type, topk_ragged_reference)(logits, ks, ke, topk)


@topk_ragged.register_fake
def _topk_ragged_fake(logits, ks, ke, topk):
    _check_topk("topk_ragged", logits, ks, ke, topk)
    return logits.new_empty((logits.shape[0], topk), dtype=torch.int32)


def _check_topk_paged(logits, ks, ke, topk, kv_slots) -> None:
    _check_topk("topk_paged", logits, ks, ke, topk)
    check_tensor("topk_paged", "kv_slots", kv_slots, dtype=torch.int64, ndim=1, shape=(logits.shape[1],))
    check_same_device("topk_paged", logits=logits, kv_slots=kv_slots)


def topk_paged_reference(logits, ks, ke, topk, kv_slots):
    ragged = _select_topk(logits, ks, ke, topk).long()
    table = F.pad(kv_slots, (0, 1), value=-1)  # -1 picks read the extra entry (and N == 0 stays indexable)
    slots = table.index_select(0, torch.where(ragged < 0, kv_slots.shape[0], ragged).view(-1)).view(ragged.shape)
    return torch.where(ragged >= 0, slots, torch.full((), -1, dtype=slots.dtype, device=slots.device)).to(torch.int32)


@torch.library.custom_op("cpgraph::topk_paged", mutates_args=())
def topk_paged(logits: Tensor, ks: Tensor, ke: Tensor, topk: int, kv_slots: Tensor) -> Tensor:
    """Same selection as ``topk_ragged``, values mapped to PAGED coordinates ``kv_slots[t]``.

    ``kv_slots`` int64 ``[N]`` maps each full-view row to its physical KV slot
    (``page * page_size + offset``); ``-1`` stays ``-1``.  Slot ids are what a
    kernel that reads the paged pool directly consumes.
    """
    _check_topk_paged(logits, ks, ke, topk, kv_slots)
    _check_window_values("topk_paged", ks, ke, logits.shape[1])
    return select("topk_paged", logits.device.type, topk_paged_reference)(logits, ks, ke, topk, kv_slots)


@topk_paged.register_fake
def _topk_paged_fake(logits, ks, ke, topk, kv_slots):
    _check_topk_paged(logits, ks, ke, topk, kv_slots)
    return logits.new_empty((logits.shape[0], topk), dtype=torch.int32)


# ------------------------------------------------------------------ indexer_topk
def logits_chunk_rows(num_keys: int, max_logits_bytes: int) -> int:
    """Rows per chunk so that a chunk's fp32 ``[rows, num_keys]`` logits fit the budget (>= 1)."""
    return max(1, max_logits_bytes // (4 * max(num_keys, 1)))


def _check_indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes) -> None:
    _check_scoring("indexer_topk", q, k, weights, ks, ke)
    _check_budget(topk, max_logits_bytes)


def _check_budget(topk, max_logits_bytes) -> None:
    _check_topk_arg("indexer_topk", topk)
    if isinstance(max_logits_bytes, bool) or not isinstance(max_logits_bytes, int) or max_logits_bytes < 1:
        raise ValueError(
            f"cpgraph.indexer_topk: argument 'max_logits_bytes' must be an int >= 1, got {max_logits_bytes!r}"
        )


def _check_indexer_topk_fp8(q, k, weights, ks, ke, k_scale) -> None:
    """The FP8 form's inputs (``indexer_logits_fp8``'s checks under this op's argument names)."""
    _check_fp8_scoring("indexer_topk", "q", "k", q, k, k_scale, weights, ks, ke)


def indexer_topk_reference(q, k, weights, ks, ke, topk, max_logits_bytes, k_scale=None):
    m, n = q.shape[0], k.shape[0]
    rows = logits_chunk_rows(n, max_logits_bytes)
    if k_scale is not None:  # FP8 bytes: keys decoded once, queries a chunk at a time
        k = e4m3_decode(k) * k_scale.unsqueeze(-1)
    out = torch.empty((m, topk), dtype=torch.int32, device=q.device)
    for a in range(0, m, rows):
        b = min(m, a + rows)
        qa = q[a:b] if k_scale is None else e4m3_decode(q[a:b])
        logits = _masked_logits(qa, k, weights[a:b], ks[a:b], ke[a:b])
        out[a:b] = _select_topk(logits, ks[a:b], ke[a:b], topk)
    return out


@torch.library.custom_op("cpgraph::indexer_topk", mutates_args=())
def indexer_topk(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    topk: int,
    max_logits_bytes: int,
    k_scale: Optional[Tensor] = None,
) -> Tensor:
    """Fused ``topk_ragged(indexer_logits(q, k, weights, ks, ke), ks, ke, topk)`` in row chunks.

    Rows are scored ``logits_chunk_rows(N, max_logits_bytes)`` at a time so a
    chunk's fp32 ``[rows, N]`` logits never exceed ``max_logits_bytes``
    (at least one row per chunk).  The chunking depends on shapes and the
    budget only, so results do not depend on it.  Returns int32 ``[M, topk]``
    RAGGED ids (map to slots with ``take_rows``/``topk_paged`` semantics).

    With ``k_scale`` (fp32 ``[N]``) the inputs are the FP8 operands of
    ``indexer_logits_fp8`` (``q`` uint8 e4m3 ``[M, H, D]``, ``k`` uint8 e4m3
    ``[N, D]``, ``weights`` with the q scale folded in) and the result is
    ``topk_ragged(indexer_logits_fp8(q, k, k_scale, weights, ks, ke), ks, ke, topk)``,
    chunked the same way.
    """
    if k_scale is None:
        _check_indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes)
    else:
        _check_indexer_topk_fp8(q, k, weights, ks, ke, k_scale)
        _check_budget(topk, max_logits_bytes)
        _check_key_scales("indexer_topk", k_scale)
    _check_window_values("indexer_topk", ks, ke, k.shape[0])
    fn = select("indexer_topk", q.device.type, indexer_topk_reference)
    if k_scale is None:
        return fn(q, k, weights, ks, ke, topk, max_logits_bytes)
    return fn(q, k, weights, ks, ke, topk, max_logits_bytes, k_scale)


@indexer_topk.register_fake
def _indexer_topk_fake(q, k, weights, ks, ke, topk, max_logits_bytes, k_scale=None):
    if k_scale is None:
        _check_indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes)
    else:
        _check_indexer_topk_fp8(q, k, weights, ks, ke, k_scale)
        _check_budget(topk, max_logits_bytes)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)

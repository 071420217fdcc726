"""Multi-segment row mover and the materialisation pack/placement kernels, byte for byte.

CPU tensors under ``TRITON_INTERPRET=1`` (CI) or CUDA; skipped otherwise.
Expected bytes come from plain indexing loops (the mover) and from the torch
references of ``cpgraph.ops.materialize`` (pack/placement; those are checked
against an unsplit full view in ``tests/ops/test_materialize.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)

import cpgraph.ops  # noqa: E402,F401
from cpgraph.kernels import materialize as kmat  # noqa: E402
from cpgraph.kernels import segments  # noqa: E402
from cpgraph.kernels.move import Layout  # noqa: E402
from cpgraph.ops import materialize as omat  # noqa: E402

DEV = "cpu" if os.environ.get("TRITON_INTERPRET", "") == "1" else "cuda"


def _bytes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8).to(DEV)


def _index(n_out, n_src, seed, holes=0.25):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_src, n_out)
    idx[rng.random(n_out) < holes] = -1
    return torch.from_numpy(idx).to(DEV)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 16, 82, 99, 144, 127, 1000])
def test_pieces_cover_width(width):
    a, b, c = segments.pieces(width)
    for p in (a, b, c):
        assert p == 0 or p & (p - 1) == 0
    assert a >= b >= c or c == 0
    assert a + b + c >= width and a <= width
    if bin(width).count("1") <= 3:
        assert a + b + c == width  # exact: no masked lane


def test_gather_two_paged_segments():
    """index_k_gather-like: two segments of a paged source, own word sizes, -1 rows zero."""
    page, stride = 4, 4 * (24 + 4)
    src = _bytes((5, stride), 0)
    idx = _index(13, 20, 1)
    key = torch.empty(13, 24, dtype=torch.uint8, device=DEV)
    sc = torch.empty(13, 4, dtype=torch.uint8, device=DEV)
    segs = [
        segments.Segment(src, key, Layout(stride, page=page, tok_stride=24), 24, 24),
        segments.Segment(src, sc, Layout(stride, page=page, tok_stride=4, base=page * 24), 4, 4),
    ]
    segments.move_segments(segs, idx, 13, segments.GATHER)
    for r, s in enumerate(idx.tolist()):
        if s < 0:
            assert not key[r].any() and not sc[r].any()
            continue
        p, o = divmod(s, page)
        assert torch.equal(key[r], src[p, o * 24 : o * 24 + 24])
        assert torch.equal(sc[r], src[p, page * 24 + o * 4 : page * 24 + o * 4 + 4])


def test_scatter_and_copy_with_zero_padding():
    rows = _bytes((9, 13), 2)
    dst = _bytes((12, 16), 3)
    before = dst.clone()
    idx = torch.tensor([3, -1, 0, 11, 5, -1, 7, 1, 9], device=DEV)
    # store 16 bytes per row of which 13 are loaded: the 3 extra are zeros
    segments.move_segments([segments.Segment(rows, dst, Layout(13), 16, 13, store_bytes=16)], idx, 9, segments.SCATTER)
    for r in range(12):
        if r in idx.tolist():
            i = idx.tolist().index(r)
            assert torch.equal(dst[r, :13], rows[i]) and not dst[r, 13:].any()
        else:
            assert torch.equal(dst[r], before[r])
    out = _bytes((9, 24), 4)
    segments.move_segments([segments.Segment(rows, out, Layout(13), 24, 13, dst_base=8, store_bytes=16)], None, 9, segments.COPY)
    assert torch.equal(out[:, 8:21], rows) and not out[:, 21:].any()


# --------------------------------------------------------- materialisation
KIND_SETS = [
    [(656, torch.uint8), (128, torch.uint8), (1, torch.float32)],  # production payload
    [(5, torch.float32), (3, torch.uint8), (7, torch.bfloat16), (2, torch.int64), (1, torch.float32)],  # 5 kinds
    [(1100, torch.float32), (4, torch.uint8)],  # a kind wider than a narrow row
    [(0, torch.float32), (6, torch.float16)],  # an empty kind
]


def _payload(kinds, n, seed):
    out = []
    for k, (w, dtype) in enumerate(kinds):
        b = _bytes((n, w * torch.empty(0, dtype=dtype).element_size()), seed + k)
        out.append(b.view(dtype) if b.shape[1] else torch.empty(n, 0, dtype=dtype, device=DEV))
    return out


@pytest.mark.parametrize("k", range(len(KIND_SETS)))
@pytest.mark.parametrize("num_prefix", [0, 5])
def test_pack_and_place_match_reference(k, num_prefix):
    kinds, world, m = KIND_SETS[k], 2, 7
    sends_ref, sends = [], []
    for rank in range(world):
        pre = _payload(kinds, num_prefix, 100 * rank)
        cur = _payload(kinds, m, 100 * rank + 50)
        if num_prefix and cur[-1].shape[1]:  # a prefix payload with strided rows (a column slice)
            wide = torch.cat([pre[-1], pre[-1]], dim=1)
            pre[-1] = wide[:, : pre[-1].shape[1]]
        columns, row_bytes = omat.packed_columns(cur)
        assert all(c % omat.PACK_ALIGN == 0 for c in columns) and row_bytes % omat.PACK_ALIGN == 0
        want = omat.pack_reference(pre, cur, columns, row_bytes)
        got = kmat.pack_rows(pre, cur, columns, row_bytes)
        assert torch.equal(got, want)
        sends_ref.append(want)
        sends.append(got)
    gathered = torch.cat(sends)  # what the all-gather returns
    source = _index(23, gathered.shape[0], seed=k)
    want = omat.place_reference(gathered, source, columns, cur)
    got = kmat.place_rows(gathered, source, columns, cur)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


def test_pack_replays_recorded_plan():
    """The second pack of a geometry replays the recorded launches: same bytes as the reference, new data."""
    kmat._PACK_PLANS.clear()
    g = torch.Generator().manual_seed(7)
    for round_ in range(3):
        cur = [
            torch.randint(0, 256, (29, 656), generator=g).to(torch.uint8).to(DEV),
            torch.randint(0, 256, (29, 128), generator=g).to(torch.uint8).to(DEV),
            torch.rand(29, 1, generator=g).to(DEV),
        ]
        pre = [c[:6] for c in cur]
        columns, row_bytes = omat.packed_columns(cur)
        got = kmat.pack_rows(pre, cur, columns, row_bytes)
        assert torch.equal(got.cpu(), omat.pack_reference(pre, cur, columns, row_bytes).cpu()), round_
        assert len(kmat._PACK_PLANS) == 1  # recorded on the first call, replayed afterwards

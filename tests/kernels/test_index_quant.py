"""The FP8 indexer's operand kernels (``cpgraph/kernels/index_quant.py``) byte for byte against the references.

``hadamard``, ``index_k_quant`` and ``indexer_q_quant`` on CPU tensors under ``TRITON_INTERPRET=1``
(CI) or on CUDA; skipped otherwise.  Every comparison is of bytes, not values: the kernels are
exact by construction (same fp32 operations in the same order, integer-exact casts).  The one
tolerance: a byte or float that is NaN in both is equal whatever its sign or payload (the torch
casts' NaN sign differs between CPU vector code, CPU scalar code and CUDA; the kernels write one
NaN code).  Shapes include odd row counts, a single row, empty inputs, strided operands and
special values (signed zeros, subnormals, infinities, NaN, amax exactly ``448 * 2**k`` and one
ulp above).  The ``gpu`` tests at the end run V3.2's 32K-token shapes and a CUDA-graph replay.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from kernel_env import kernel_device

if kernel_device() is None:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)

import cpgraph.kernels as kernels  # noqa: E402
import cpgraph.ops  # noqa: E402,F401
from cpgraph.kernels import index_quant as iq  # noqa: E402
from cpgraph.ops import ledger  # noqa: E402
from cpgraph.ops.codecs import index_k_quant_reference  # noqa: E402
from cpgraph.ops.indexer import hadamard_reference, indexer_q_quant_reference  # noqa: E402
from cpgraph.ops.providers import calls, register_provider  # noqa: E402

DEV = kernel_device()
# The interpreter evaluates inf - inf and 0 * inf with numpy, which warns; the results are what IEEE says.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
ops = torch.ops.cpgraph
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF, NAN = float("inf"), float("nan")


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape, dtype and bytes; NaN equals NaN (any sign, any payload); ``-0.0`` is not ``+0.0``."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.numel() == 0:
        return True
    got, want = got.contiguous().cpu().reshape(-1), want.contiguous().cpu().reshape(-1)
    if got.dtype == torch.uint8:  # e4m3 bytes: 0x7F and 0xFF are the NaN codes
        return torch.equal(torch.where((got & 0x7F) == 0x7F, 0x7F, got), torch.where((want & 0x7F) == 0x7F, 0x7F, want))
    both_nan = torch.isnan(got) & torch.isnan(want)
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    return bool((both_nan | (got.view(bits) == want.view(bits))).all())


def _randn(shape, dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _specials(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x [R >= 8, D >= 4]`` set to edge cases: zeros, ``-0.0``, mixed signed zeros, a row at
    ``448 * 2**-3`` and one just above it, subnormal-sized, large, and ``inf`` / NaN entries."""
    x = x.clone()
    x[0] = 0.0
    x[1] = -0.0
    x[2, ::2] = -0.0
    x[2, 1::2] = 0.0
    x[3, 0] = 56.0  # 448 / 8: a power-of-two quotient
    x[4, 0] = torch.nextafter(torch.tensor(56.0), torch.tensor(INF)).to(x.dtype)  # one ulp above (fp32)
    x[5] *= 1e-6
    x[6] = x[6].sign() * 1e4
    x[7, 1] = INF
    x[7, 2] = -INF
    if x.shape[0] > 8:
        x[8, 3] = NAN
    return x


# --------------------------------------------------------------------- hadamard
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 128), (5, 3, 64), (1, 1), (3, 2), (0, 128), (2, 1024)])
def test_hadamard_matches_reference(dtype, shape):
    x = _randn(shape, dtype, seed=sum(shape))
    assert same(iq.hadamard(x), hadamard_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_special_values(dtype):
    """Signed zeros survive exactly as the reference's butterflies make them (no reduction that starts at +0)."""
    x = _specials(_randn((11, 128), dtype, seed=1))
    got = iq.hadamard(x)
    assert same(got, hadamard_reference(x))
    assert torch.equal(got[1].float().signbit().cpu(), hadamard_reference(x)[1].float().signbit().cpu())


def test_hadamard_strided_input_gives_contiguous_output():
    base = _randn((64, 9, 16), torch.bfloat16, seed=2)
    x = base.transpose(0, 2)[:, 3:7, :]  # [16, 4, 64], last dim strided
    got = iq.hadamard(x)
    assert got.is_contiguous() and same(got, hadamard_reference(x))


# ---------------------------------------------------------------- index_k_quant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 128), (9, 32), (4, 300), (1, 128), (0, 128), (3, 0)])
def test_index_k_quant_matches_reference(dtype, shape):
    keys = _randn(shape, dtype, seed=sum(shape) + 3)
    got, want = iq.index_k_quant(keys), index_k_quant_reference(keys)
    assert same(got[0], want[0]) and same(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_k_quant_special_values_and_strided_keys(dtype):
    wide = _specials(_randn((11, 200), dtype, seed=4))
    keys = wide[:, 40:168]  # rows strided by 200
    got, want = iq.index_k_quant(keys), index_k_quant_reference(keys)
    assert same(got[0], want[0]) and same(got[1], want[1])


# -------------------------------------------------------------- indexer_q_quant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 8, 128), (5, 3, 32), (3, 1, 7), (1, 64, 128), (0, 4, 128)])
def test_indexer_q_quant_matches_reference(dtype, shape):
    q = _randn(shape, dtype, seed=sum(shape) + 5)
    w = _randn(shape[:2], torch.float32, seed=6, scale=0.1)
    got, want = iq.indexer_q_quant(q, w), indexer_q_quant_reference(q, w)
    assert same(got[0], want[0]) and same(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_q_quant_special_values(dtype):
    """Edge rows, and the non-finite rows: NaN -> NaN scale and weight, inf -> inf scale, +-0 bytes."""
    q = _specials(_randn((11, 128), dtype, seed=7)).view(11, 1, 128)
    w = _randn((11, 1), torch.float32, seed=8)
    got, want = iq.indexer_q_quant(q, w), indexer_q_quant_reference(q, w)
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert torch.isinf(got[1][7]).all() and torch.isnan(got[1][8]).all()


def test_indexer_q_quant_fp32_amax_just_above_a_power_of_two():
    """fp32 amax one to three ulps above ``448 * 2**k``: the exact ceiling (scale ``2**(k+1)``), as the reference."""
    amax = torch.tensor([448.0 * 2.0**k for k in range(-20, 30, 3)])
    rows = [amax, torch.nextafter(amax, torch.tensor(INF))]
    rows.append(torch.nextafter(rows[-1], torch.tensor(INF)))
    rows.append(torch.nextafter(rows[-1], torch.tensor(INF)))
    amax = torch.cat(rows)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(amax.shape[0], 1, 128, generator=g).clamp(-1, 1) * amax[:, None, None]
    q[:, 0, 17] = amax
    q, w = q.to(DEV), torch.ones(amax.shape[0], 1, device=DEV)
    got, want = iq.indexer_q_quant(q, w), indexer_q_quant_reference(q, w)
    assert same(got[0], want[0]) and same(got[1], want[1])
    n = amax.shape[0] // 4
    assert torch.equal(got[1][n:].cpu(), 2 * got[1][:n].cpu().repeat(3, 1))  # one power of two up, not saturated


def test_indexer_q_quant_strided_operands():
    q = _randn((8, 37, 128), torch.bfloat16, seed=10).transpose(0, 1)  # [37, 8, 128], rows not m-major
    w = _randn((8, 37), torch.float32, seed=11).t()
    got, want = iq.indexer_q_quant(q, w), indexer_q_quant_reference(q, w)
    assert same(got[0], want[0]) and same(got[1], want[1])


# ------------------------------------------------------------ indexer_q_prepare
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 8, 128), (5, 3, 32), (1, 64, 128), (0, 4, 128), (6, 2, 1)])
def test_indexer_q_prepare_is_the_rotation_then_the_quantisation(dtype, shape):
    """Byte for byte the two references in sequence: the rotation rounded to ``dtype``, then quantised."""
    q = _randn(shape, dtype, seed=sum(shape) + 25)
    w = _randn(shape[:2], torch.float32, seed=26, scale=0.1)
    got = iq.indexer_q_prepare(q, w)
    want = indexer_q_quant_reference(hadamard_reference(q), w)
    assert same(got[0], want[0]) and same(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_q_prepare_special_values_and_strided_operands(dtype):
    q = _specials(_randn((11, 128), dtype, seed=27)).view(11, 1, 128)
    w = _randn((11, 1), torch.float32, seed=28)
    got, want = iq.indexer_q_prepare(q, w), indexer_q_quant_reference(hadamard_reference(q), w)
    assert same(got[0], want[0]) and same(got[1], want[1])
    q = _randn((8, 37, 128), dtype, seed=33).transpose(0, 1)  # [37, 8, 128], rows not m-major
    w = _randn((8, 37), torch.float32, seed=34).t()
    got, want = iq.indexer_q_prepare(q, w), indexer_q_quant_reference(hadamard_reference(q), w)
    assert same(got[0], want[0]) and same(got[1], want[1])


# ---------------------------------------------------------------- row locality
def test_rows_depend_only_on_themselves():
    """A row's bytes are the same in any batch: a permuted subset gives the permuted subset of the results."""
    q = _specials(_randn((45, 128), torch.bfloat16, seed=12)).view(15, 3, 128)
    w = _randn((15, 3), torch.float32, seed=13)
    k = q[:, 0]
    pick = torch.tensor([14, 3, 8, 0, 9], device=DEV)
    assert same(iq.hadamard(q[pick]), iq.hadamard(q)[pick])
    assert all(same(a, b[pick]) for a, b in zip(iq.index_k_quant(k[pick]), iq.index_k_quant(k)))
    assert all(same(a, b[pick]) for a, b in zip(iq.indexer_q_quant(q[pick], w[pick]), iq.indexer_q_quant(q, w)))
    assert all(same(a, b[pick]) for a, b in zip(iq.indexer_q_prepare(q[pick], w[pick]), iq.indexer_q_prepare(q, w)))


def test_tile_size_does_not_change_bytes(monkeypatch):
    """Rows per program follow the tile setting; the bytes do not (checked with one row per program)."""
    monkeypatch.setattr(iq, "interpreting", lambda: False)  # use TILES, not the interpreter's large tiles
    q = _randn((5, 2, 128), torch.float16, seed=14)
    w = _randn((5, 2), torch.float32, seed=15)
    one = (128, 4)
    assert same(iq.hadamard(q, tile=one), hadamard_reference(q))
    assert all(same(a, b) for a, b in zip(iq.index_k_quant(q[:, 0], tile=one), index_k_quant_reference(q[:, 0])))
    assert all(same(a, b) for a, b in zip(iq.indexer_q_quant(q, w, tile=one), indexer_q_quant_reference(q, w)))


# ------------------------------------------------------- the ops and the ledger
OPS = ("hadamard", "index_k_quant", "indexer_q_quant", "indexer_q_prepare")


@contextmanager
def triton_providers():
    """The Triton providers registered for ``DEV`` for the block (on CUDA they are already; put back as found)."""
    from provider_state import registry_restored

    with registry_restored(DEV):
        for op in OPS:
            register_provider(op, DEV, kernels.PROVIDER_NAME, kernels.providers()[op])
            ledger.forget(op, DEV)
        yield


def _counts(op: str) -> list[tuple]:
    return [(r["implementation"], r["calls"], r["reason"]) for r in calls(DEV).get(op, [])]


def test_ops_run_the_triton_providers_and_the_ledger_says_so():
    q = _randn((6, 4, 128), torch.bfloat16, seed=16)
    w = _randn((6, 4), torch.float32, seed=17)
    with triton_providers():
        qh = ops.hadamard(q)
        kb = ops.index_k_quant(qh[:, 0])
        qb = ops.indexer_q_quant(qh, w)
        qp = ops.indexer_q_prepare(q, w)
        assert [_counts(op) for op in OPS] == [[("triton", 1, None)]] * 4
    assert same(qh, hadamard_reference(q))
    assert all(same(a, b) for a, b in zip(kb, index_k_quant_reference(qh[:, 0])))
    assert all(same(a, b) for a, b in zip(qb, indexer_q_quant_reference(qh, w)))
    assert all(same(a, b) for a, b in zip(qp, qb))  # the fused op is the pair, to the byte


def test_rows_wider_than_the_kernel_fall_back_with_a_reason(caplog, monkeypatch):
    monkeypatch.setattr(ledger, "_LOGGED", set())  # the warning is once per process and reason
    x = _randn((2, 2 * iq.MAX_D), torch.float32, seed=18)
    reason = f"last dim above {iq.MAX_D} (a program holds whole rows)"
    with triton_providers(), caplog.at_level("WARNING"):
        for _ in range(2):
            assert same(ops.hadamard(x), hadamard_reference(x))
            assert all(same(a, b) for a, b in zip(ops.index_k_quant(x), index_k_quant_reference(x)))
        assert _counts("hadamard") == [("reference", 2, reason)]
        assert _counts("index_k_quant") == [("reference", 2, reason)]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and reason in r.getMessage()]
    assert len(warned) == 2  # once per op


def test_opcheck_with_the_triton_providers():
    q = _randn((5, 2, 128), torch.bfloat16, seed=19)
    w = _randn((5, 2), torch.float32, seed=20)
    with triton_providers():
        torch.library.opcheck(ops.hadamard.default, (q,))
        torch.library.opcheck(ops.index_k_quant.default, (q[:, 0].contiguous(),))
        torch.library.opcheck(ops.indexer_q_quant.default, (q, w))
        for args in ((q, w), (_randn((3, 4, 64), torch.float32, seed=29), _randn((3, 4), torch.float32, seed=30)),
                     (_randn((7, 1, 128), torch.float16, seed=31), _randn((7, 1), torch.float32, seed=32))):
            torch.library.opcheck(ops.indexer_q_prepare.default, args)


@pytest.mark.skipif(DEV != "cpu", reason="CPU (interpreter) only: on CUDA the rest of the forward would have to be "
                    "bitwise reproducible run to run too; the gpu test below covers these kernels there")
def test_fp8_cache_prefill_is_the_same_with_the_kernels(monkeypatch):
    """A tiny FP8-cache prefill (every layer's indexer runs hadamard on k, index_k_quant and indexer_q_prepare)
    gives the reference run's bits."""
    from cpgraph.models import DSAConfig, build_model, init_random, prefill
    from cpgraph.models.config import bundled_config_dict

    cfg = DSAConfig.from_hf_dict(bundled_config_dict("tiny-deepseek-v32-fp8"))  # index 128-dim heads
    model = init_random(build_model(cfg), seed=0, std=0.02).to(DEV)
    prompts = [[5, 9, 1, 44, 3, 7, 100, 2, 8], [3] * 12]
    with triton_providers():
        monkeypatch.setenv("CPGRAPH_PROVIDERS", ",".join(f"{op}:reference" for op in OPS))
        want = prefill(model, prompts, kv_format="fp8", return_topk=True)
        monkeypatch.delenv("CPGRAPH_PROVIDERS")
        for op in OPS:
            ledger.forget(op, DEV)
        got = prefill(model, prompts, kv_format="fp8", return_topk=True)
        ran = {op: {r["implementation"] for r in calls(DEV).get(op, [])} for op in OPS}
    assert ran == {op: {"triton"} for op in OPS if op != "indexer_q_quant"} | {"indexer_q_quant": set()}
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.topk, want.topk))


# --------------------------------------------------------- production (GPU)
gpu = pytest.mark.skipif(DEV != "cuda", reason="production shapes need a CUDA device")


@gpu
@pytest.mark.gpu
def test_gpu_v32_shapes_bit_exact_and_graph_replay():
    """V3.2 at 32K tokens: q ``[32768, 64, 128]``, k ``[32768, 128]`` bf16; then the launches replayed in a graph."""
    g = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(32768, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(32768, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(32768, 64, device="cuda", generator=g) * 0.01
    qh, kh = iq.hadamard(q), iq.hadamard(k)
    assert same(qh, hadamard_reference(q)) and same(kh, hadamard_reference(k))
    assert all(same(a, b) for a, b in zip(iq.index_k_quant(kh), index_k_quant_reference(kh)))
    want_q = indexer_q_quant_reference(qh, w)
    assert all(same(a, b) for a, b in zip(iq.indexer_q_quant(qh, w), want_q))
    assert all(same(a, b) for a, b in zip(iq.indexer_q_prepare(q, w), want_q))

    small_q, small_w = q[:4096].clone(), w[:4096].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        iq.indexer_q_quant(iq.hadamard(small_q), small_w)  # compile / warm the launchers off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = iq.indexer_q_quant(iq.hadamard(small_q), small_w)
    torch.cuda.current_stream().wait_stream(stream)
    small_q.copy_(q[4096:8192])
    small_w.copy_(w[4096:8192])
    graph.replay()
    torch.cuda.synchronize()
    assert same(out[0], want_q[0][4096:8192]) and same(out[1], want_q[1][4096:8192])

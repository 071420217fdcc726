"""Owner-sharded KV materialisation: descriptors (host) and ``cp_materialize_kv`` (gloo, 2 and 4 ranks).

A scenario is a planner batch plus a radix-like prefix cache: every cached
prefix page is a *logical* page with an owner rank and a physical page on
that owner; requests may share logical pages (same physical page on the
owner).  The expected full view of every payload kind is written with plain
Python loops from the spec: prefix rows from the logical pages' contents,
extend rows from this forward's token values, page-tail slack zero.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpgraph.ops  # noqa: F401  (registers take_rows & co)
from cpgraph.ops.materialize import cp_materialize_kv, cp_materialize_kv_decomposed
from cpgraph.passes.lint import host_sync_nodes
from cpgraph.plan import plan_prefill
from cpgraph.plan.materialize import MaterializeDescriptors, materialize_descriptors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import collective_calls, fake_group, shared_pool  # noqa: E402

pytestmark = pytest.mark.slow

# Payload kinds: dense fp32 record, dense bf16 record, fp8 MLA record bytes
# (656), index-key e4m3 bytes, index-key fp32 scales.
KINDS = [(torch.float32, 8), (torch.bfloat16, 6), (torch.uint8, 656), (torch.uint8, 16), (torch.float32, 1)]


# ------------------------------------------------------------------ scenario
@dataclass
class Scenario:
    world: int
    page_size: int
    prefix_pages: list  # prefix_pages[i] = logical page ids of request i's cached prefix
    extend: list
    owner: list  # owner[L] = owner rank of logical page L
    phys: list  # phys[L] = physical page of L on its owner
    pool_pages: int
    row_align: int

    @property
    def prefix(self):
        return [len(p) * self.page_size for p in self.prefix_pages]

    def plan(self):
        return plan_prefill(self.prefix, self.extend, cp_size=self.world, page_size=self.page_size,
                            row_align=self.row_align)

    def owners_of(self):
        return [[self.owner[L] for L in pages] for pages in self.prefix_pages]

    def local_pages(self, rank):
        return [[self.phys[L] if self.owner[L] == rank else -1 for L in pages] for pages in self.prefix_pages]


def make_scenario(world, page_size, prefix_page_counts, extend, shares=(), owner_of=None, seed=0, row_align=1):
    """``shares``: (a, b, n) = request b's first n prefix pages are request a's first n pages."""
    rng = np.random.default_rng(seed)
    pages, next_id = [], 0
    for n in prefix_page_counts:
        pages.append(list(range(next_id, next_id + n)))
        next_id += n
    for a, b, n in shares:
        pages[b][:n] = pages[a][:n]
    num_logical = next_id
    owner = [int(x) for x in rng.integers(0, world, size=num_logical)] if owner_of is None else [
        owner_of(L) for L in range(num_logical)]
    pool_pages = num_logical + 3  # some pages hold unrelated data
    perms = [list(rng.permutation(pool_pages)) for _ in range(world)]
    phys = [int(perms[owner[L]].pop()) for L in range(num_logical)]
    return Scenario(world, page_size, pages, list(extend), owner, phys, pool_pages, row_align)


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def contents(sc: Scenario):
    """Per kind: (logical page rows [num_logical * page, W], extend token rows [T, W]), same on all ranks."""
    num_logical = len(sc.owner)
    return [
        (_random((num_logical * sc.page_size, w), dt, 100 + k), _random((sum(sc.extend), w), dt, 200 + k))
        for k, (dt, w) in enumerate(KINDS)
    ]


def rank_inputs(sc: Scenario, rank: int, desc: MaterializeDescriptors, token_index: torch.Tensor):
    """What a rank holds: its local pools (owned pages only, garbage elsewhere) and its compute rows."""
    ps = sc.page_size
    prefix_rows, current_rows = [], []
    for k, ((dt, w), (page_rows, ext_rows)) in enumerate(zip(KINDS, contents(sc))):
        pool = _random((sc.pool_pages * ps, w), dt, 1000 * rank + k)
        for L, (o, p) in enumerate(zip(sc.owner, sc.phys)):
            if o == rank:
                pool[p * ps : (p + 1) * ps] = page_rows[L * ps : (L + 1) * ps]
        # The caller's local gather (paged_gather in production): -1 slots -> zero rows.
        prefix_rows.append(torch.ops.cpgraph.take_rows(pool, desc.send_slots))
        garbage = _random((token_index.numel(), w), dt, 5000 + k)  # dummy rows: must never land
        real = ext_rows.index_select(0, token_index.clamp(min=0))
        current_rows.append(torch.where((token_index >= 0)[:, None], real, garbage))
    return prefix_rows, current_rows


def expected_views(sc: Scenario):
    """The full view of every kind, written from the spec with Python loops."""
    ps = sc.page_size
    out = []
    for (dt, w), (page_rows, ext_rows) in zip(KINDS, contents(sc)):
        rows, tok = [], 0
        for pages, e in zip(sc.prefix_pages, sc.extend):
            for L in pages:
                for o in range(ps):
                    rows.append(page_rows[L * ps + o])
            for t in range(math.ceil(e / ps) * ps):
                rows.append(ext_rows[tok + t] if t < e else torch.zeros(w, dtype=dt))
            tok += e
        out.append(torch.stack(rows))
    return out


def brute_descriptors(sc: Scenario, rank: int):
    """send_slots / prefix_dest / current_dest / kv_rows with loops (independent of the builder)."""
    ps, world = sc.page_size, sc.world
    kv_start, acc = [], 0
    for pages, e in zip(sc.prefix_pages, sc.extend):
        kv_start.append(acc)
        acc += len(pages) * ps + math.ceil(e / ps) * ps
    kv_rows = acc
    owned = [[] for _ in range(world)]  # per rank: (full-view row, slot)
    for i, pages in enumerate(sc.prefix_pages):
        for j, L in enumerate(pages):
            for o in range(ps):
                owned[sc.owner[L]].append((kv_start[i] + j * ps + o, sc.phys[L] * ps + o))
    P = max(len(x) for x in owned)
    prefix_dest = []
    for r in range(world):
        prefix_dest += [d for d, _ in owned[r]] + [-1] * (P - len(owned[r]))
    send_slots = [s for _, s in owned[rank]] + [-1] * (P - len(owned[rank]))
    plan = sc.plan()
    starts, acc = [], 0
    for e in sc.extend:
        starts.append(acc)
        acc += e
    current_dest = []
    for r in range(world):
        for g in plan.rank(r).token_index.tolist():
            if g < 0:
                current_dest.append(-1)
                continue
            i = max(k for k in range(len(starts)) if starts[k] <= g)
            current_dest.append(kv_start[i] + sc.prefix[i] + (g - starts[i]))
    return send_slots, prefix_dest, current_dest, kv_rows


def brute_kv_source(prefix_dest, current_dest, world, kv_rows):
    """Invert the destination lists with a loop: gathered row of every full-view row."""
    P, M = len(prefix_dest) // world, len(current_dest) // world
    src = [-1] * kv_rows
    for r in range(world):
        for j in range(P):
            d = prefix_dest[r * P + j]
            if d >= 0:
                assert src[d] == -1, "two sources for one full-view row"
                src[d] = r * (P + M) + j
        for j in range(M):
            d = current_dest[r * M + j]
            if d >= 0:
                assert src[d] == -1, "two sources for one full-view row"
                src[d] = r * (P + M) + P + j
    return src


# Dist scenarios: many requests with shared prefixes, no prefix at all,
# tiny extends with every prefix page on rank 0 and a fully shared prefix.
def scenario_specs(world):
    return [
        dict(world=world, page_size=4, prefix_page_counts=[1, 0, 3, 0, 2, 1, 0, 0, 4, 1, 0, 2],
             extend=[1, 2, 3, 7, 9, 16, 1, 33, 4, 17, 2, 40], shares=[(2, 8, 3), (0, 9, 1)], seed=world, row_align=8),
        dict(world=world, page_size=4, prefix_page_counts=[0, 0, 0], extend=[5, 1, 19], seed=1),
        dict(world=world, page_size=2, prefix_page_counts=[2, 1, 2], extend=[1, 1, 2], shares=[(0, 2, 2)],
             owner_of=lambda L: 0, seed=2),
        dict(world=world, page_size=1, prefix_page_counts=[3, 5], extend=[6, 2], shares=[(0, 1, 3)], seed=3),
    ]


def _build(ctx_rank, spec):
    sc = make_scenario(**spec)
    plan = sc.plan()
    desc = materialize_descriptors(plan, sc.owners_of(), sc.local_pages(ctx_rank), ctx_rank)
    rp = plan.rank(ctx_rank)
    prefix_rows, current_rows = rank_inputs(sc, ctx_rank, desc, rp.token_index)
    return sc, desc, prefix_rows, current_rows


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ------------------------------------------------------------ rank-side jobs
def job_materialize(ctx, spec_index):
    spec = scenario_specs(ctx.world_size)[spec_index]
    sc, desc, prefix_rows, current_rows = _build(ctx.rank, spec)
    args = (prefix_rows, current_rows, desc.kv_source, ctx.group_name, ctx.world_size)
    got = cp_materialize_kv(*args)
    want = expected_views(sc)
    assert len(got) == len(KINDS)
    for k, (g, w) in enumerate(zip(got, want)):
        assert _same(g, w), f"payload {k} ({KINDS[k]}) differs from the unsplit full view"
    for g, d in zip(got, cp_materialize_kv_decomposed(*args)):
        assert _same(g, d)
    counts = collective_calls(lambda: cp_materialize_kv(*args))
    return {"P": desc.prefix_rows_per_rank, "counts": counts}


def job_opcheck(ctx):
    for spec_index in (0, 1, 2):
        _, desc, prefix_rows, current_rows = _build(ctx.rank, scenario_specs(ctx.world_size)[spec_index])
        args = (prefix_rows, current_rows, desc.kv_source, ctx.group_name, ctx.world_size)
        torch.library.opcheck(torch.ops.cpgraph.cp_materialize_kv.default, args)


def job_inductor(ctx):
    """The decomposition compiled by Inductor (what the lowering pass produces) moves the same bytes."""
    sc, desc, prefix_rows, current_rows = _build(ctx.rank, scenario_specs(ctx.world_size)[0])
    gn, ws = ctx.group_name, ctx.world_size

    def lowered(prefix_rows, current_rows, kv_source):
        return cp_materialize_kv_decomposed(prefix_rows, current_rows, kv_source, gn, ws)

    # Scalar C++ kernels: the bytes moved are decided by the graph Inductor lowers (one collective and
    # the gathers around it), not by the CPU vector code, and they compile in about 40% less time.
    # torch config modules patch themselves.
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        compiled = torch.compile(lowered, backend="inductor", fullgraph=True)
        got = compiled(prefix_rows, current_rows, desc.kv_source)
    for k, (g, w) in enumerate(zip(got, expected_views(sc))):
        assert _same(g, w), f"payload {k} differs after Inductor"


# ------------------------------------------------------------ dist tests
@pytest.mark.parametrize("world_size", [2, 4])
def test_materialize_matches_unsplit_full_view(world_size):
    pool = shared_pool(world_size)
    for spec_index in range(len(scenario_specs(world_size))):
        results = pool.run(job_materialize, spec_index)
        assert len({r["P"] for r in results}) == 1  # every rank agrees on P without communicating
        for r in results:
            # ONE collective per call, carrying all five payload kinds.
            assert r["counts"] == {"_c10d_functional::all_gather_into_tensor": 1, "gloo:all_gather": 1}


def test_opcheck():
    shared_pool(2).run(job_opcheck)


def test_inductor_compiled_decomposition():
    shared_pool(2).run(job_inductor)


# ------------------------------------------------- descriptors (host, no group)
def _check_against_brute(sc: Scenario):
    plan = sc.plan()
    fv_written = []
    for rank in range(sc.world):
        desc = materialize_descriptors(plan, sc.owners_of(), sc.local_pages(rank), rank)
        send_slots, prefix_dest, current_dest, kv_rows = brute_descriptors(sc, rank)
        assert desc.send_slots.tolist() == send_slots
        assert desc.kv_source.tolist() == brute_kv_source(prefix_dest, current_dest, sc.world, kv_rows)
        assert desc.kv_rows == kv_rows == desc.kv_source.numel()
        assert desc.prefix_rows_per_rank * sc.world == len(prefix_dest)
        assert desc.num_rows * sc.world == len(current_dest)
        assert all(t.dtype == torch.int64 for t in (desc.send_slots, desc.kv_source))
        fv_written = [d for d in prefix_dest + current_dest if d >= 0]
    # Every full-view row except page-tail slack is written exactly once.
    slack = set()
    kv = 0
    for pages, e in zip(sc.prefix_pages, sc.extend):
        kv += len(pages) * sc.page_size
        slack |= set(range(kv + e, kv + math.ceil(e / sc.page_size) * sc.page_size))
        kv += math.ceil(e / sc.page_size) * sc.page_size
    assert sorted(fv_written) == sorted(set(range(kv)) - slack)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_descriptors_match_brute_force(world):
    for spec in scenario_specs(world):
        _check_against_brute(make_scenario(**spec))


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(1, 4),
    page_size=st.sampled_from([1, 2, 4]),
    reqs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=6),
    share=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_descriptors_property(world, page_size, reqs, share, seed):
    counts = [c for c, _ in reqs]
    extend = [e for _, e in reqs]
    shares = []
    if share and len(reqs) > 1 and counts[0] and counts[-1]:
        shares = [(0, len(reqs) - 1, min(counts[0], counts[-1]))]
    _check_against_brute(make_scenario(world, page_size, counts, extend, shares, seed=seed))


def test_shared_physical_page_maps_per_request():
    """Two requests sharing a cached page on its owner get separate full-view rows."""
    sc = make_scenario(2, 2, [2, 2], [3, 1], shares=[(0, 1, 2)], owner_of=lambda L: 1)
    plan = sc.plan()
    desc = materialize_descriptors(plan, sc.owners_of(), sc.local_pages(1), 1)
    slots = desc.send_slots.tolist()
    assert len(slots) == 8 and slots[:4] == slots[4:]  # the owner sends the shared pages once per request
    src = desc.kv_source.tolist()
    block1 = desc.prefix_rows_per_rank + desc.num_rows  # rank 1's block starts here
    kv_start1 = int(plan.kv_start[1])
    assert src[0:4] == [block1 + j for j in range(4)]
    assert src[kv_start1 : kv_start1 + 4] == [block1 + 4 + j for j in range(4)]
    # Rank 0 owns nothing: no full-view row comes from its prefix block.
    assert not [x for x in src if 0 <= x < desc.prefix_rows_per_rank]


def test_descriptors_to_device():
    sc = make_scenario(2, 2, [1, 0], [3, 2], seed=0)
    desc = materialize_descriptors(sc.plan(), sc.owners_of(), sc.local_pages(0), 0)
    moved = desc.to("meta")
    assert moved.send_slots.device.type == "meta" and moved.kv_source.device.type == "meta"
    assert moved.kv_rows == desc.kv_rows and desc.send_slots.device.type == "cpu"


# ------------------------------------------------- descriptor input errors
def _errors_sc():
    return make_scenario(2, 2, [2, 1], [3, 2], owner_of=lambda L: L % 2)


def test_descriptor_errors_counts():
    sc = _errors_sc()
    with pytest.raises(ValueError, match="prefix_page_owners has 1 entries"):
        materialize_descriptors(sc.plan(), sc.owners_of()[:1], sc.local_pages(0), 0)
    with pytest.raises(ValueError, match=r"local_prefix_pages\[0\] \(request 0\) has 1 entries"):
        materialize_descriptors(sc.plan(), sc.owners_of(), [[5], [-1]], 0)


def test_descriptor_errors_owner_range():
    sc = _errors_sc()
    with pytest.raises(ValueError, match="owner outside"):
        materialize_descriptors(sc.plan(), [[0, 2], [0]], sc.local_pages(0), 0)


def test_descriptor_errors_ownership_mismatch():
    sc = _errors_sc()  # owners [[0, 1], [0]]
    with pytest.raises(ValueError, match="request 1, prefix page 0 but has no page"):
        materialize_descriptors(sc.plan(), sc.owners_of(), [[3, -1], [-1]], 0)
    with pytest.raises(ValueError, match="request 0, prefix page 1 is owned by another rank"):
        materialize_descriptors(sc.plan(), sc.owners_of(), [[3, 4], [5]], 0)


def test_descriptor_errors_types():
    sc = _errors_sc()
    with pytest.raises(ValueError, match="rank must be"):
        materialize_descriptors(sc.plan(), sc.owners_of(), sc.local_pages(0), 2)
    with pytest.raises(ValueError, match="plan must be a CPPlan"):
        materialize_descriptors(sc.plan().rank(0), sc.owners_of(), sc.local_pages(0), 0)
    with pytest.raises(ValueError, match="must hold integers"):
        materialize_descriptors(sc.plan(), [[0.0, 1.0], [0]], sc.local_pages(0), 0)


# ------------------------------------------------- fake group (this process)
def test_trace_and_compile_with_fake_group():
    with fake_group(world_size=4, rank=2) as gn:
        spec = scenario_specs(4)[0]
        sc, desc, prefix_rows, current_rows = _build(2, spec)

        def op(prefix_rows, current_rows, kv_source):
            return torch.ops.cpgraph.cp_materialize_kv(prefix_rows, current_rows, kv_source, gn, 4)

        def decomposed(prefix_rows, current_rows, kv_source):
            return cp_materialize_kv_decomposed(prefix_rows, current_rows, kv_source, gn, 4)

        args = (prefix_rows, current_rows, desc.kv_source)
        want = [((desc.kv_rows, w), dt) for dt, w in KINDS]
        for fn in (op, decomposed):
            gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
            targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            collectives = [t for t in targets if "c10d_functional" in t and "wait_tensor" not in t]
            if fn is op:
                assert sum("cpgraph.cp_materialize_kv" in t for t in targets) == 1 and not collectives
            else:  # the lowering target: exactly one collective, visible to Inductor
                assert len(collectives) == 1 and "all_gather_into_tensor" in collectives[0]
            assert not host_sync_nodes(gm.graph), "host sync in a traced CP op"
            for out in (gm(*args), torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)):
                assert [(tuple(o.shape), o.dtype) for o in out] == want

        # Dynamic compile: the full view's size follows kv_source's (symbolic) length.
        def dyn(prefix_rows, current_rows, kv_source, world_size):
            return torch.ops.cpgraph.cp_materialize_kv(prefix_rows, current_rows, kv_source, gn, world_size)

        torch._dynamo.reset()
        compiled = torch.compile(dyn, backend="aot_eager", fullgraph=True, dynamic=True)
        for extra in (0, 5):
            longer = torch.cat([desc.kv_source, torch.full((extra,), -1, dtype=torch.int64)])
            out = compiled(prefix_rows, current_rows, longer, 4)
            assert [(tuple(o.shape), o.dtype) for o in out] == [((desc.kv_rows + extra, w), dt) for dt, w in KINDS]


def test_world_size_must_match_group():
    with fake_group(world_size=4, rank=0) as gn:
        _, desc, prefix_rows, current_rows = _build(0, scenario_specs(2)[1])
        with pytest.raises(ValueError, match="world_size"):
            cp_materialize_kv(prefix_rows, current_rows, desc.kv_source, gn, 2)


# ------------------------------------------------------- op input errors
def _args(**over):
    base = dict(
        prefix_rows=[torch.zeros(4, 3), torch.zeros(4, 5, dtype=torch.uint8)],
        current_rows=[torch.zeros(6, 3), torch.zeros(6, 5, dtype=torch.uint8)],
        kv_source=torch.full((10,), -1, dtype=torch.int64),
        group_name="g",
        world_size=2,
    )
    base.update(over)
    return base


def test_op_errors_payload_count():
    a = _args()
    with pytest.raises(ValueError, match="'prefix_rows' has 1 payloads but 'current_rows' has 2"):
        cp_materialize_kv(**_args(prefix_rows=a["prefix_rows"][:1]))
    with pytest.raises(ValueError, match="at least one payload"):
        cp_materialize_kv(**_args(prefix_rows=[], current_rows=[]))


def test_op_errors_payload_dtype_and_width():
    a = _args()
    with pytest.raises(ValueError, match=r"payload 1: 'prefix_rows\[1\]' is torch.float32"):
        cp_materialize_kv(**_args(prefix_rows=[a["prefix_rows"][0], torch.zeros(4, 5)]))
    with pytest.raises(ValueError, match=r"'prefix_rows\[0\]' must have shape"):
        cp_materialize_kv(**_args(prefix_rows=[torch.zeros(4, 4), a["prefix_rows"][1]]))


def test_op_errors_payload_rows():
    a = _args()
    with pytest.raises(ValueError, match=r"'prefix_rows\[1\]' must have shape"):
        cp_materialize_kv(**_args(prefix_rows=[a["prefix_rows"][0], torch.zeros(3, 5, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match=r"'current_rows\[0\]' must be 2-D"):
        cp_materialize_kv(**_args(current_rows=[torch.zeros(6, 3, 1), a["current_rows"][1]]))


def test_op_errors_source_dtype_and_rank():
    with pytest.raises(ValueError, match="'kv_source' must have dtype int64"):
        cp_materialize_kv(**_args(kv_source=torch.full((8,), -1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="'kv_source' must be 1-D"):
        cp_materialize_kv(**_args(kv_source=torch.full((2, 6), -1, dtype=torch.int64)))


def test_op_errors_scalars():
    with pytest.raises(ValueError, match="'world_size'"):
        cp_materialize_kv(**_args(world_size=0))
    with pytest.raises(ValueError, match="'group_name'"):
        cp_materialize_kv(**_args(group_name=""))


def test_op_errors_device_mix():
    with pytest.raises(ValueError, match="one device"):
        cp_materialize_kv(**_args(kv_source=torch.full((12,), -1, dtype=torch.int64, device="meta")))


def test_source_range_checked_in_debug_mode(monkeypatch):
    # 2 ranks x (4 prefix + 6 current) rows = 20 gathered rows: 20 is out of range.
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="outside"):
        cp_materialize_kv_decomposed(**_args(kv_source=torch.tensor([0, 20], dtype=torch.int64)))
    with pytest.raises(ValueError, match="outside"):
        torch.ops.cpgraph.kv_compose([torch.zeros(2, 3)], [torch.zeros(3, 3)], torch.tensor([5]))


# ------------------------------------------------------------ kv_compose
@pytest.mark.parametrize("spec_index", [0, 1, 2, 3])
def test_kv_compose_is_the_single_device_materialisation(spec_index):
    spec = dict(scenario_specs(1)[spec_index], world=1)
    sc = make_scenario(**spec)
    plan = sc.plan()
    desc = materialize_descriptors(plan, sc.owners_of(), sc.local_pages(0), 0)
    prefix_rows, current_rows = rank_inputs(sc, 0, desc, plan.rank(0).token_index)
    got = torch.ops.cpgraph.kv_compose(prefix_rows, current_rows, desc.kv_source)
    for k, (g, w) in enumerate(zip(got, expected_views(sc))):
        assert _same(g, w), f"payload {k} differs from the unsplit full view"
    if spec_index < 3:
        torch.library.opcheck(torch.ops.cpgraph.kv_compose.default, (prefix_rows, current_rows, desc.kv_source))

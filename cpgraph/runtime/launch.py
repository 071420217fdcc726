"""CP prefill in ranks started by ``torchrun`` (one node or many): ``cpgraph launch``.

``cpgraph run --cp N`` spawns its own ranks on one machine; a job that spans
machines is started by ``torchrun`` instead, which starts one process per GPU
on every node and hands each its place through the environment.  This module
is what such a process runs:

1. read the rendezvous from the environment (:func:`read_env`): ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` -- all
   five, or a one-line error naming the missing ones;
2. lay the world out (:func:`rank_layout`): ``WORLD_SIZE = dp * cp`` with
   CP group ``g`` = global ranks ``[g*cp, (g+1)*cp)``; ``ep`` (1 or ``cp``)
   splits routed experts inside a CP group;
3. join the world (NCCL on CUDA with the rank bound to ``cuda:LOCAL_RANK``,
   gloo on CPU) and create every CP group's process group on every rank, in
   the same order (``dist.new_group`` is collective over the world);
4. read the group's prompts (round-robin over the groups, or one file per
   group) and load the model; a bad input on ANY rank is gathered and
   reported by all ranks as one line, so no rank is left waiting in a
   collective for a peer that already quit;
5. compile with the CP passes on the group's process group and prefill the
   group's batch as its group rank;
6. gather every rank's result on global rank 0, which alone returns a
   :class:`LaunchResult` (logits in the original prompt order).

Why the checks split at step 3: what every rank reads identically (flags,
environment layout, the model config) fails before any process group exists,
on every rank alike; what may differ per rank (a group's prompts file, a
checkpoint shard on one node's disk) is checked after joining, and the
verdict is shared.  The ranks map, the environment variables and the
commands are documented in ``docs/launch.md``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch

from .inputs import (
    InputError,
    builtin_prompts,
    check_output_path,
    check_parallel,
    check_request,
    check_weights,
    model_config,
    one_line,
    read_prompts,
    user_input,
)

log = logging.getLogger(__name__)

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
GROUP_PLACEHOLDER = "{group}"  # in --prompts-file: one file per data-parallel group


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def read_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The rendezvous variables; :class:`InputError` (one line) when one is missing or malformed."""
    env = os.environ if environ is None else environ
    missing = [v for v in RENDEZVOUS_VARS if not env.get(v, "").strip()]
    if len(missing) == len(RENDEZVOUS_VARS):
        raise InputError("this command runs in ranks started by torchrun, but none of "
                         f"{', '.join(RENDEZVOUS_VARS)} is set (on one machine without torchrun use "
                         "'cpgraph run --cp N')")
    if missing:
        raise InputError(f"rendezvous variable(s) {', '.join(missing)} not set: every rank needs all of "
                         f"{', '.join(RENDEZVOUS_VARS)} (torchrun sets them)")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        text = env[name].strip()
        try:
            values[name] = int(text)
        except ValueError:
            raise InputError(f"environment variable {name} must be an integer, got {text!r}") from None
    rank, world, local, port = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["MASTER_PORT"]
    if world < 1:
        raise InputError(f"environment variable WORLD_SIZE must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise InputError(f"environment variable RANK={rank} is outside [0, WORLD_SIZE={world})")
    if local < 0 or local > rank:
        raise InputError(f"environment variable LOCAL_RANK={local} must be in [0, RANK={rank}]")
    if not 0 < port < 65536:
        raise InputError(f"environment variable MASTER_PORT must be a TCP port in [1, 65535], got {port}")
    return LaunchEnv(rank, world, local, env["MASTER_ADDR"].strip(), port)


def reports_errors(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints a launch error: local rank 0 of each node, or any process with a bad environment.

    Errors after step 3 are the same on every rank (they are shared), and so
    are flag errors; one line per node is enough.
    """
    try:
        return read_env(environ).local_rank == 0
    except InputError:
        return True


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class RankLayout:
    """How the world's ranks map to data-parallel groups, CP groups and expert shards.

    Global rank ``r`` is rank ``r % cp`` of CP group ``r // cp``; the groups
    are data-parallel replicas, each prefilling its own batch.  With
    ``ep == cp``, group rank ``j`` holds routed experts
    ``[j * E/ep, (j+1) * E/ep)``; with ``ep == 1`` every rank holds all.
    """

    world_size: int
    cp: int
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    def group_of(self, rank: int) -> int:
        return rank // self.cp

    def group_rank(self, rank: int) -> int:
        return rank % self.cp

    def group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.cp, (group + 1) * self.cp))

    def expert_range(self, rank: int, num_experts: int) -> tuple[int, int]:
        """``[first, end)`` routed-expert ids rank ``rank`` holds."""
        if self.ep == 1:
            return 0, num_experts
        per = num_experts // self.ep
        j = self.group_rank(rank) % self.ep
        return j * per, (j + 1) * per


def rank_layout(world_size: int, cp: int, ep: int = 1, num_experts: int | None = None) -> RankLayout:
    """Check and build the layout (:func:`~cpgraph.runtime.inputs.check_parallel` says what is refused)."""
    check_parallel(cp=cp, ep=ep, world_size=world_size, num_experts=num_experts)
    return RankLayout(world_size, cp, ep)


def compiler_config(layout: RankLayout, group, deterministic: bool = False):
    """The :class:`~cpgraph.passes.CPConfig` a rank compiles with: its CP group, and EP as the layout says.

    With ``ep > 1`` the rank holds only its expert shard, so the compiler must
    know the degree to insert the expert-parallel dispatch around each MoE.
    """
    from cpgraph.passes import CPConfig

    return CPConfig(group=group, cp_size=layout.cp, ep=layout.ep, deterministic=deterministic)


def round_robin(num_prompts: int, dp: int) -> list[list[int]]:
    """Prompt indices of each data-parallel group: prompt ``i`` goes to group ``i % dp``."""
    if num_prompts < dp:
        raise InputError(f"{num_prompts} prompt(s) for {dp} data-parallel groups: every group needs at least one "
                         "(give more prompts or a larger --cp)")
    return [list(range(g, num_prompts, dp)) for g in range(dp)]


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``cpu``, or ``cuda:LOCAL_RANK`` (``auto``: CUDA when visible); one-line errors for a rank without a GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise InputError(f"--device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is visible")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise InputError(f"LOCAL_RANK {local_rank} has no GPU: {count} visible on this node "
                         "(--nproc-per-node must not exceed the GPUs per node)")
    return torch.device("cuda", local_rank)


# ----------------------------------------------------------------------------- spec and result


@dataclass
class LaunchSpec:
    model: str
    prompts_file: str | None = None  # JSON list of token-id lists; "{group}" in the name: one file per group
    prefix_lens: list[int] | None = None  # per prompt of the (single) prompts file
    cp: int | None = None  # None: the whole world is one CP group
    ep: int = 1
    device: str = "auto"
    backend: str = "inductor"
    kv_format: str = "bf16"
    dtype: str | None = None
    weights: str | None = None  # FP8 checkpoints: None / "dequantize" (to dtype) or "fp8" (e4m3 projections kept)
    page_size: int = 16
    timeout: float = 600.0  # seconds a collective (and the rendezvous) may wait
    repeat: int = 1  # prefill runs; the first includes compilation
    json_out: str | None = None  # checked (writable) on global rank 0 before the run; the caller writes it
    deterministic: bool = False  # CPConfig(deterministic=True): row-invariant products (docs/deterministic.md)


@dataclass
class GroupReport:
    group: int
    ranks: list[int]
    prompt_indices: list[int]  # positions in LaunchResult.tokens
    kv_bytes_per_rank: list[int]
    weight_bytes_per_rank: list[int]  # parameters and buffers each rank holds (its expert shard under EP)
    pages_per_rank: list[int]
    replicated_bytes: int
    seconds: list[float]  # per run on the group's rank 0; seconds[0] includes compilation
    ranks_agree: bool  # every rank of the group returned the same logits


@dataclass
class LaunchResult:
    """Global rank 0's view of the whole job."""

    logits: torch.Tensor  # fp32 [B, vocab], in the order of ``tokens``
    tokens: list[list[int]]
    prefix_lens: list[int]
    layout: RankLayout
    device: str
    backend: str
    weights: str = "dequantize"  # how FP8 checkpoints were loaded (LaunchSpec.weights)
    groups: list[GroupReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- prompts


def group_prompts(spec: LaunchSpec, dp: int, group: int, vocab: int) -> tuple[list[int], list, list[int]]:
    """``(indices in the job's prompt order, prompts, prefix lengths)`` of one group (unchecked lengths)."""
    path = spec.prompts_file
    if path is not None and GROUP_PLACEHOLDER in path:
        if spec.prefix_lens is not None:
            raise InputError(f"--prefix-lens applies to one prompts file, not to one file per group ({path!r})")
        # Indices follow the concatenation of the groups' files in group order.
        sizes = [len(read_prompts(path.replace(GROUP_PLACEHOLDER, str(g)))) for g in range(dp)]
        prompts = read_prompts(path.replace(GROUP_PLACEHOLDER, str(group)))
        start = sum(sizes[:group])
        return list(range(start, start + len(prompts))), prompts, [0] * len(prompts)
    prompts = read_prompts(path) if path is not None else builtin_prompts(vocab)
    prefix = spec.prefix_lens if spec.prefix_lens is not None else [0] * len(prompts)
    if len(prefix) != len(prompts):
        raise InputError(f"prefix lengths have {len(prefix)} entries for {len(prompts)} prompts")
    idx = round_robin(len(prompts), dp)[group]
    return idx, [prompts[i] for i in idx], [prefix[i] for i in idx]


# ----------------------------------------------------------------------------- one rank


def _dtype(name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[name]


def load_rank_model(spec: LaunchSpec, layout: RankLayout, group_rank: int, *, draft: bool = False):
    """This rank's model as ``spec`` asks (dtype, FP8 weights, its expert shard) and its KV layout.

    With EP each rank builds and reads only its routed experts (rank ``j``
    of the group: shard ``j``); ``spec.weights == "fp8"`` keeps the FP8
    checkpoint's e4m3 projections (``from_pretrained(..., weights="fp8")``); ``draft`` also loads
    the MTP draft layer (docs/mtp.md).
    Raises :class:`InputError` (through :func:`user_input`) for a bad checkpoint.
    """
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout

    shard = dict(ep_rank=group_rank % layout.ep, ep_size=layout.ep) if layout.ep > 1 else {}
    model = from_pretrained(spec.model, dtype=_dtype(spec.dtype), weights=spec.weights, draft=draft, **shard)
    return model, make_layout(model, spec.kv_format, spec.page_size)


def _share_verdict(error: str | None, rank: int, world: int) -> None:
    """All ranks learn whether any rank's input was bad; each raises the first rank's message."""
    import torch.distributed as dist

    verdicts = [None] * world
    dist.all_gather_object(verdicts, error)
    for r, msg in enumerate(verdicts):
        if msg is not None:
            raise InputError(msg if r == rank else f"rank {r}: {msg}")


def run_launch(spec: LaunchSpec, environ: Mapping[str, str] | None = None,
               progress: Callable[[str], None] | None = None) -> LaunchResult | None:
    """Run this process's rank of a torchrun job; global rank 0 returns the :class:`LaunchResult`, others ``None``.

    Raises :class:`InputError` for bad flags, environment or input (on every
    rank alike), anything else for a bug.  ``progress`` gets the phases of
    each CP group's rank 0.
    """
    import torch.distributed as dist

    env = read_env(environ)
    cfg = model_config(spec.model)
    sparse = "sparse" in cfg.mlp_layer_types
    layout = rank_layout(env.world_size, spec.cp or env.world_size, spec.ep,
                         cfg.n_routed_experts if sparse else None)
    if spec.repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {spec.repeat}")
    if spec.timeout <= 0:
        raise InputError(f"--timeout must be > 0 seconds, got {spec.timeout:g}")
    check_weights(spec.model, spec.weights, cfg)  # same verdict on every rank: before any process group
    device = resolve_device(spec.device, env.local_rank)
    group_id, group_rank = layout.group_of(env.rank), layout.group_rank(env.rank)
    leader = group_rank == 0

    def report(msg: str) -> None:
        if leader and progress is not None:
            progress(f"rank {env.rank} (group {group_id}): {msg}")

    cuda = device.type == "cuda"
    if spec.weights == "fp8" and not cuda:
        report("--weights fp8 on cpu: the FP8 projections run fp8_block_linear's torch reference (slow; the fast "
               "FP8 GEMM is CUDA-only)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off unless the user turns it on
    if cuda:
        torch.cuda.set_device(device)
    # env:// (what torchrun's agent store needs) reads these; a caller may have passed its own environ.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.master_addr, str(env.master_port)
    report(f"joining the {'NCCL' if cuda else 'gloo'} world of {env.world_size} at {env.master_addr}:{env.master_port}")
    try:
        dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=spec.timeout))
    except (RuntimeError, ValueError, OSError) as exc:  # DistError / DistStoreError are RuntimeErrors
        first = one_line(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise InputError(f"cannot join the process group at {env.master_addr}:{env.master_port}: {first}") from exc
    try:
        return _run_joined(spec, env, layout, cfg, device, group_id, group_rank, report)
    finally:
        dist.destroy_process_group()


def _run_joined(spec, env: LaunchEnv, layout: RankLayout, cfg, device, group_id: int, group_rank: int, report):
    import torch.distributed as dist

    from cpgraph.passes import compile
    from cpgraph.runtime.engine import run_prefill, weight_bytes_per_rank

    # Every rank creates every group, in group order: new_group is collective over the world.
    groups = [dist.new_group(layout.group_ranks(g)) for g in range(layout.dp)] if layout.dp > 1 else [dist.group.WORLD]
    group = groups[group_id]

    error, model = None, None
    try:
        with user_input():
            if env.rank == 0:
                check_output_path(spec.json_out)  # only global rank 0 writes it
            indices, prompts, prefix = group_prompts(spec, layout.dp, group_id, cfg.vocab_size)
            req = check_request(prompts, prefix, vocab=cfg.vocab_size, page_size=spec.page_size, cp=layout.cp)
            report(f"{len(prompts)} prompt(s); loading {spec.model}"
                   + (" (FP8 weights kept)" if spec.weights == "fp8" else ""))
            model, kv_layout = load_rank_model(spec, layout, group_rank)
    except InputError as exc:
        error = one_line(exc)
    _share_verdict(error, env.rank, env.world_size)

    model = model.to(device).eval()
    model.kv_layout = kv_layout
    weight_bytes = weight_bytes_per_rank(model)
    compiled = compile(model, compiler_config(layout, group, spec.deterministic), backend=spec.backend, dynamic=True)

    def forward(ids, meta, mla, index, **kw):
        return compiled(ids, meta, mla, index, **kw)

    seconds, res = [], None
    for n in range(spec.repeat):
        report(f"run {n + 1}/{spec.repeat}{' (compiles first)' if n == 0 else ''}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        res = run_prefill(forward, model, req.prompts, prefix_lens=req.prefix_lens, kv_format=spec.kv_format,
                          page_size=spec.page_size, rank=group_rank, cp_size=layout.cp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        if n == 0:
            check_expert_parallel_graph(getattr(compiled, "cpgraph_passes", None), layout.ep)
    logits = res.logits.float().cpu()
    digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest()
    item = dict(rank=env.rank, group=group_id, group_rank=group_rank, indices=indices, tokens=req.prompts,
                prefix=req.prefix_lens, logits=logits.numpy() if group_rank == 0 else None, digest=digest,
                kv_bytes=res.kv_bytes, weight_bytes=weight_bytes, pages=res.pages_owned, replicated=res.total_pages * res.bytes_per_page,
                seconds=seconds)
    report("gathering results on global rank 0")
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(item, gathered, dst=0)
    dist.barrier()
    if env.rank != 0:
        return None
    return _assemble(gathered, layout, device, spec.backend, spec.weights or "dequantize")


EP_DISPATCH_OP = "moe_dispatch"  # what an expert-parallel graph must contain (cpgraph::moe_dispatch)


def check_expert_parallel_graph(manager, ep: int) -> None:
    """With ``ep > 1`` the compiled graph must send rows to their experts' ranks; refuse one that does not.

    Each EP rank holds only ``E / ep`` experts, so a graph without the
    dispatch would silently drop the other experts' contributions.  The pass
    manager's last op counts show what the CP passes produced (the same
    graph on every rank, so every rank decides alike).  When the passes did
    not run in this process (an FX-graph cache hit) there is nothing to
    inspect; that is logged.
    """
    if ep == 1:
        return
    history = getattr(manager, "history", None)
    if not history:
        log.warning("cpgraph launch: --ep %d: the CP passes did not run here (compile cache hit); "
                    "the expert-parallel dispatch could not be checked", ep)
        return
    final = history[-1][2]
    if not any(EP_DISPATCH_OP in str(name) for name in final):
        raise InputError(f"--ep {ep}: the compiled graph has no expert-parallel dispatch (cpgraph::{EP_DISPATCH_OP});"
                         " this build cannot run expert parallelism yet, use --ep 1")


def _assemble(items: Sequence[dict], layout: RankLayout, device, backend: str,
              weights: str = "dequantize") -> LaunchResult:
    n = sum(len(it["indices"]) for it in items if it["group_rank"] == 0)
    tokens: list = [None] * n
    prefix: list = [0] * n
    rows: list = [None] * n
    reports = []
    for g in range(layout.dp):
        members = sorted((it for it in items if it["group"] == g), key=lambda it: it["group_rank"])
        lead = members[0]
        logits = torch.from_numpy(lead["logits"])
        for row, i in enumerate(lead["indices"]):
            tokens[i], prefix[i], rows[i] = lead["tokens"][row], lead["prefix"][row], logits[row]
        reports.append(GroupReport(
            group=g, ranks=[it["rank"] for it in members], prompt_indices=list(lead["indices"]),
            kv_bytes_per_rank=[it["kv_bytes"] for it in members],
            weight_bytes_per_rank=[it["weight_bytes"] for it in members], pages_per_rank=[it["pages"] for it in members],
            replicated_bytes=lead["replicated"], seconds=lead["seconds"],
            ranks_agree=all(it["digest"] == lead["digest"] for it in members)))
    return LaunchResult(logits=torch.stack(rows), tokens=tokens, prefix_lens=prefix, layout=layout,
                        device=str(device.type), backend=backend, weights=weights, groups=reports)

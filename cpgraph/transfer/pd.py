"""``cpgraph pd``: N prefill CP ranks + one decode process on loopback.

Prefill ranks (gloo, the model compiled with the CP passes when N > 1,
eager when N == 1) each run a :class:`PrefillPeer`; the decode process
registers its pool with every rank, waits for the room statuses (minimum
over ranks), reads the first token from the aux record, runs a 1-token
extend over the received cache and compares the logits with transformers'
next-token logits for ``prompt + [first_token]``.

Overlap share: each rank prefills twice with transfer, once sending after
the forward and once per layer; the share hidden is ``1 - tail_overlap /
tail_sequential`` where a tail is the time from the end of the forward to
the end of the last send.  It is reported only as far as it was measured
as overlap: the ranks count the layers their hooks sent while the forward
ran.  A forward that writes KV through functional copies (``aot_eager``
CP ranks) sends every layer after the forward; then the share is 0 by
construction -- the two tails differ only by noise -- and one note says so
(see docs/transfer.md).

Logging: the ranks and decode are spawned processes; they get the parent's
``cpgraph`` log level (``PDSpec.log_level``, default the logger's effective
level), and Mooncake's own log follows it (``engine.set_log_level``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp


@dataclass
class PDSpec:
    model: str
    prompts: list
    prefix_lens: list | None = None
    chunk_tokens: int | None = None
    cp: int = 1
    page_size: int = 16
    kv_format: str = "bf16"
    backend: str = "inductor"
    group: int = 1
    timeout: float = 120.0
    log_level: int | None = None  # cpgraph log level in the spawned processes (None: the parent's effective level)


@dataclass
class PDResult:
    first_tokens: list[int]
    decode_logits: object  # numpy [B, vocab]
    hf_logits: object  # numpy [B, vocab]
    max_abs_diff: float
    bytes_sent: int
    transfer_seconds: float
    hidden_share: float
    tail_sequential: float
    tail_overlap: float
    statuses: list[int]
    notes: list[str] = field(default_factory=list)
    layers_per_layer: int = 0  # layer sends the hooks enqueued while the forward ran (all ranks, all chunks)
    layers_after_forward: int = 0  # layer sends left to after the forward in the per-layer run

    @property
    def gbps(self) -> float:
        return self.bytes_sent / max(self.transfer_seconds, 1e-9) / 1e9

    @property
    def overlap_measured(self) -> bool:
        """True when some layer was sent while the forward ran (else ``hidden_share`` is 0 by construction)."""
        return self.layers_per_layer > 0

    def transfer_line(self) -> str:
        """One line for the CLI: bytes, rate and the overlap, stated only as far as it was measured."""
        head = f"transfer: {self.bytes_sent} bytes sent in {self.transfer_seconds * 1e3:.2f} ms = {self.gbps:.3f} GB/s; "
        if not self.overlap_measured:
            return head + "no overlap: every layer was sent after the forward (0% hidden)"
        share = f"hidden behind the forward: {100 * self.hidden_share:.1f}%"
        mixed = "" if not self.layers_after_forward else \
            f", {self.layers_after_forward} of {self.layers_per_layer + self.layers_after_forward} layer sends after it"
        return head + (f"{share} (tail {self.tail_sequential * 1e3:.2f} ms sequential -> "
                       f"{self.tail_overlap * 1e3:.2f} ms per-layer{mixed})")


FALLBACK_NOTE = ("the CP forward writes KV through functional copies (a graph without reinplacing, e.g. --backend "
                 "aot_eager): every layer was sent after the forward, so nothing was hidden; --backend inductor "
                 "sends per layer")


def hidden_share(tail_sequential: float, tail_overlap: float, layers_per_layer: int) -> float:
    """Share of the sequential transfer tail that the per-layer run hid; 0 when no layer went per layer."""
    if layers_per_layer <= 0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - tail_overlap / max(tail_sequential, 1e-9))))


def _child_logging(level: int) -> None:
    """A spawned process logs at the parent's level (and Mooncake follows it)."""
    from .engine import set_log_level

    logger = logging.getLogger("cpgraph")
    logger.setLevel(level)
    if level < logging.WARNING and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    set_log_level(level)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_reference(name: str, model):
    """transformers model with ``model``'s weights: a bundled tiny config, or a local checkpoint's ``config.json``."""
    import json
    from pathlib import Path

    import transformers

    from cpgraph.models.config import bundled_config_dict

    local = Path(name) / "config.json"
    d = json.loads(local.read_text()) if local.is_file() else bundled_config_dict(name)
    cls = {"deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
           "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM)}[d["model_type"]]
    cfg = cls[0](**{k: v for k, v in d.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")})
    cfg._attn_implementation = "eager"
    hf = cls[1](cfg).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def _prefill_rank(rank: int, spec: PDSpec, port: int, addr_q, out_q, rooms_pass) -> None:
    try:
        _child_logging(spec.log_level)
        import torch.distributed as dist

        from cpgraph.models import from_pretrained
        from cpgraph.models.prefill import make_layout

        from .driver import make_pool, prefill_and_send
        from .overlap import attach_layer_hooks
        from .prefill import PrefillPeer

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // (spec.cp + 1)))
        model = from_pretrained(spec.model).eval()
        model.kv_layout = layout = make_layout(model, spec.kv_format, spec.page_size)
        if spec.cp > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=spec.cp)
            from cpgraph.passes import CPConfig, compile

            compiled = compile(model, CPConfig(group=dist.group.WORLD, cp_size=spec.cp), backend=spec.backend,
                               dynamic=True)

            def forward(ids, meta, mla, index):
                return compiled(ids, meta, mla, index)
        else:
            def forward(ids, meta, mla, index):
                return model(ids, meta, mla, index, layout)
        kw = dict(prefix_lens=spec.prefix_lens, chunk_tokens=spec.chunk_tokens, kv_format=spec.kv_format,
                  page_size=spec.page_size, rank=rank, cp_size=spec.cp)
        prefill_and_send(forward, model, spec.prompts, **kw)  # warm-up (compiles)
        pools = [make_pool(model, spec.prompts, **kw) for _ in range(2)]
        peers = [PrefillPeer(p, rank, group=spec.group, timeout=spec.timeout) for p in pools]
        addr_q.put((rank, [p.address for p in peers]))
        B = len(spec.prompts)
        tails, fallback = [], []
        for k, (pool, peer, overlap) in enumerate(zip(pools, peers, (False, True))):
            hooks = attach_layer_hooks(model, peer.manager, pool, on_fallback=fallback.append) if overlap else []
            tail = [0.0]

            def timed(ids, meta, mla, index):
                out = forward(ids, meta, mla, index)
                tail[0] = time.perf_counter()
                return out

            res = prefill_and_send(timed, model, spec.prompts, pool=pool, peer=peer,
                                   rooms=[k * B + i for i in range(B)], overlap=overlap, **kw)
            tails.append(time.perf_counter() - tail[0])
            for h in hooks:
                h.remove()
        m = [peers[1].sender.metric(k) for k in range(B, 2 * B)]
        ms = [peers[0].sender.metric(k) for k in range(B)]
        out_q.put(("rank", rank, dict(bytes=sum(x.bytes_sent for x in m),
                                      seconds=sum(x.seconds for x in ms), bytes_seq=sum(x.bytes_sent for x in ms),
                                      tails=tails, statuses=res.statuses, fallback=bool(fallback),
                                      per_layer=peers[1].layers_per_layer,
                                      after_forward=peers[1].layers_after_forward)))
        rooms_pass.get(timeout=spec.timeout)  # keep the peers alive until decode is done
        for p in peers:
            p.close()
        if spec.cp > 1:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        out_q.put(("error", rank, f"prefill rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _decode_proc(spec: PDSpec, peers_q, out_q) -> None:
    try:
        _child_logging(spec.log_level)
        from cpgraph.models import from_pretrained
        from cpgraph.models.prefill import make_layout
        from cpgraph.runtime.engine import pool_config
        from cpgraph.runtime.kv_pool import KVPool

        from .decode import DecodeSide, decode_step

        torch.set_num_threads(1)
        model = from_pretrained(spec.model).eval()
        layout = make_layout(model, spec.kv_format, spec.page_size)
        B, ps = len(spec.prompts), spec.page_size
        pages = 2 * sum((len(p) + ps) // ps + 1 for p in spec.prompts)
        dec = DecodeSide(KVPool(pool_config(model, spec.kv_format, ps, pages, 0)), max_rooms=2 * B)
        addrs = peers_q.get(timeout=spec.timeout)  # [rank][run] -> address
        tables = {}
        for run in range(2):
            for i, p in enumerate(spec.prompts):
                tables[run * B + i] = dec.open_room(run * B + i, len(p), [a[run] for a in addrs])
        statuses = [int(dec.wait(r, spec.timeout)) for r in range(2 * B)]
        rooms = list(range(B, 2 * B))  # decode over the per-layer (overlapped) transfer
        toks = [dec.first_token(r) for r in rooms]
        logits = decode_step(model, layout, dec.pool, toks, [len(p) for p in spec.prompts], [tables[r] for r in rooms])
        hf = hf_reference(spec.model, model)
        with torch.no_grad():
            ref = torch.stack([hf(torch.tensor([p + [t]])).logits[0, -1].float() for p, t in zip(spec.prompts, toks)])
        out_q.put(("decode", -1, dict(tokens=toks, logits=logits.float().numpy(), hf=ref.numpy(), statuses=statuses)))
        dec.close()
    except BaseException as exc:  # noqa: BLE001
        out_q.put(("error", -1, f"decode: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_pd(spec: PDSpec) -> PDResult:
    if spec.cp < 1:
        raise ValueError(f"--cp must be >= 1, got {spec.cp}")
    if spec.log_level is None:
        from dataclasses import replace

        spec = replace(spec, log_level=logging.getLogger("cpgraph").getEffectiveLevel())
    ctx = mp.get_context("spawn")
    addr_q, peers_q, out_q, done_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_prefill_rank, args=(r, spec, port, addr_q, out_q, done_q), daemon=True)
             for r in range(spec.cp)]
    procs.append(ctx.Process(target=_decode_proc, args=(spec, peers_q, out_q), daemon=True))
    for p in procs:
        p.start()
    deadline = time.monotonic() + spec.timeout * 3
    results, error = {}, None
    try:
        addrs = [None] * spec.cp
        for _ in range(spec.cp):
            kind, rank, payload = _get(addr_q, out_q, deadline)
            if kind == "error":
                raise RuntimeError(payload)
            addrs[rank] = payload
        peers_q.put(addrs)
        while len(results) < spec.cp + 1:
            kind, rank, payload = out_q.get(timeout=max(1.0, deadline - time.monotonic()))
            if kind == "error":
                raise RuntimeError(payload)
            results[rank] = payload
    except Exception as exc:  # noqa: BLE001
        error = exc
    finally:
        for _ in range(spec.cp):
            done_q.put(True)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if error is not None:
        raise RuntimeError(f"pd run failed: {error}")
    dec = results.pop(-1)
    ranks = [results[r] for r in range(spec.cp)]
    tail_seq = max(r["tails"][0] for r in ranks)
    tail_ovl = max(r["tails"][1] for r in ranks)
    per_layer = sum(r["per_layer"] for r in ranks)
    notes = []
    if any(r["fallback"] for r in ranks):
        notes.append(FALLBACK_NOTE)
        logging.getLogger("cpgraph.transfer").warning("cpgraph pd: %s", FALLBACK_NOTE)
    import numpy as np

    return PDResult(
        first_tokens=dec["tokens"], decode_logits=dec["logits"], hf_logits=dec["hf"],
        max_abs_diff=float(np.abs(dec["logits"] - dec["hf"]).max()),
        bytes_sent=sum(r["bytes_seq"] for r in ranks), transfer_seconds=max(r["seconds"] for r in ranks),
        hidden_share=hidden_share(tail_seq, tail_ovl, per_layer),
        tail_sequential=tail_seq, tail_overlap=tail_ovl, statuses=dec["statuses"], notes=notes,
        layers_per_layer=per_layer, layers_after_forward=sum(r["after_forward"] for r in ranks),
    )


def _get(addr_q, out_q, deadline):
    """Next address (or an error from any process) before the deadline."""
    import queue

    while time.monotonic() < deadline:
        try:
            rank, addrs = addr_q.get(timeout=0.2)
            return "addr", rank, addrs
        except queue.Empty:
            pass
        try:
            kind, rank, payload = out_q.get_nowait()
            if kind == "error":
                return kind, rank, payload
            raise RuntimeError("unexpected result before every rank reported its address")
        except queue.Empty:
            pass
    raise TimeoutError("prefill ranks did not start in time")

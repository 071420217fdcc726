"""``cpgraph serve`` under torchrun with more ranks than ``--cp``: data-parallel replicas, each on its own port.

Two ranks, ``--cp 1``: two CP groups of one rank each (the DP layout of
``cpgraph.runtime.launch.rank_layout``), each group's leader serving HTTP on
``--port + group``.  Both replicas answer the same prompt with the
single-device first token and logprobs (eager, fp32), their ``/v1/models``
name the model, and SIGTERM to the ranks (what an orchestrator's stop sends
each replica) drains both; every rank exits 0, so torchrun does too.
(SIGTERM to torchrun itself makes torchrun raise and exit non-zero after
forwarding it, whatever its workers return: torchrun's behaviour, not ours.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import StderrLines, get, logprob_table, post  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 3, 99, 42, 7, 11, 64, 2, 8, 31, 5, 77]


def _free_ports(n: int) -> list[int]:
    """``n`` consecutive free loopback ports (the replicas serve on ``base + group``)."""
    for base in range(20000 + os.getpid() % 20000, 60000, 17):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return list(range(base, base + n))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_two_dp_replicas_serve_on_their_own_ports_and_drain_on_sigterm():
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import prefill_logits

    rdzv, base, _ = _free_ports(3)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{rdzv}", "--nnodes", "1", "--nproc-per-node", "2", "-m", "cpgraph", "serve",
           "--model", "tiny-glm5", "--cp", "1", "--backend", "eager", "--device", "cpu", "--port", str(base),
           "--warmup-tokens", "8", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stderr = StderrLines(proc)
    try:
        found = stderr.wait_for(r"listening on (http://127\.0\.0\.1:(\d+)) \(CP group (\d+)", count=2, timeout=240)
        urls = {int(m.group(3)): (m.group(1), int(m.group(2))) for m in found}
        assert sorted(urls) == [0, 1], stderr.text(0)
        assert [urls[g][1] for g in (0, 1)] == [base, base + 1]  # group g on --port + g
        for url, _ in urls.values():
            for _ in range(2400):  # warm-up is eager and tiny: bounded wait
                status, _ = get(url, "/health")
                if status == 200:
                    break
                time.sleep(0.05)
            assert status == 200
        want = prefill_logits(from_pretrained("tiny-glm5", dtype=torch.float32), [PROMPT])[0].log_softmax(-1)
        answers = []
        for g in (0, 1):
            url = urls[g][0]
            status, body = post(url, {"prompt": PROMPT, "max_tokens": 1, "logprobs": 3})
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["token_ids"] == [int(want.argmax())]
            for tok, lp in logprob_table(choice).items():
                assert abs(lp - float(want[tok])) < 1e-4, (g, tok, lp, float(want[tok]))
            answers.append(choice["token_ids"])
            status, models = get(url, "/v1/models")
            assert status == 200 and models["data"][0]["id"] == "tiny-glm5"
        assert answers[0] == answers[1]
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
        text = stderr.text()
        assert text.count("draining 0 request(s) in flight") == 2, text
        assert code == 0, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

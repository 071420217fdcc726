"""``cpgraph serve --cp 2 --ep 2``: each rank holds half of the routed experts and the node answers like one device.

The model is a DeepSeek-V3.2-shaped FP8 block-quantized checkpoint on disk (written as the releases
are, ``tests/models/test_fp8_checkpoint.py``) served with ``--weights fp8``: each rank reads only its
experts' e4m3 stacks and scales.  The pool is ``--num-pages auto``: each rank sizes it from the memory
left, and the group takes the smallest.  (One command for all of it: each run compiles on two ranks.)

The real command on this machine (``--cp`` without torchrun spawns the two
gloo ranks), aot_eager: each rank loads only its expert shard (the bundled
tiny GLM-5 is drawn whole and cut), compiles with the expert-parallel
dispatch (the warm-up checks the compiled graph has it), and the answers
equal the single-device ``prefill_logits`` within ``TOL`` (CP and EP change
reduction shapes: the 2e-5 of the other CP serving tests).  A prompt longer
than the budget runs chunked.  SIGTERM to the command drains and exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from serve_utils import get, logprob_table, post  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOL = 2e-5


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_oracle import make_pair
    from test_fp8_checkpoint import blocky, per_expert, write_fp8_checkpoint

    hf, _ = make_pair(blocky("deepseek_v32"), seed=5)
    root = tmp_path_factory.mktemp("ds-fp8-ep")
    write_fp8_checkpoint(root, blocky("deepseek_v32"), per_expert(hf.state_dict()))
    return str(root)


def test_cp2_ep2_node_answers_like_one_device_and_drains(fp8_checkpoint):
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import prefill_logits

    model, load = fp8_checkpoint, {"weights": "fp8"}

    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "cpgraph", "serve", "--model", model, "--cp", "2", "--ep", "2",
           "--backend", "aot_eager", "--device", "cpu", "--port", "0", "--warmup-tokens", "16",
           "--token-budget", "32", "--dtype", "float32", "--weights", "fp8",
           "--num-pages", "auto", "--kv-memory-fraction", "0.005"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines, url = [], None
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()  # every rank's lines, whenever they come (a follower's may follow the leader's address)
    try:
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", "".join(lines))
            url = m.group(1) if m else None
            time.sleep(0.05)
        assert url is not None, "".join(lines)
        for _ in range(6000):  # the warm-up compiles on both ranks: bounded wait
            status, health = get(url, "/health")
            if status == 200 or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert status == 200, (health, "".join(lines))
        # Each rank loaded its own half of the routed experts (and holds fewer bytes than the whole model).
        shards = sorted(re.findall(r"routed experts \[(\d+), (\d+)\) of (\d+)", "".join(lines)))
        assert len(shards) == 2, "".join(lines)
        (a0, a1, n), (b0, b1, _) = [tuple(map(int, s)) for s in shards]
        assert (a0, a1, b0, b1) == (0, n // 2, n // 2, n), shards
        # --num-pages auto: each rank sized its pool, the group took the smallest
        mine = [int(x) for x in re.findall(r"KV pool auto: (\d+) pages per rank", "".join(lines))]
        agreed = re.findall(r"CP group 0: (\d+) KV pages per rank", "".join(lines))
        assert len(mine) == 2 and agreed == [str(min(mine))] * 2, "".join(lines)  # every rank the same
        g = torch.Generator().manual_seed(11)
        reference = from_pretrained(model, dtype=torch.float32, **load)
        vocab = reference.config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (30, 70, 9)]
        want = prefill_logits(reference, prompts).float().log_softmax(-1)
        for p, w in zip(prompts, want):
            status, body = post(url, {"prompt": p, "max_tokens": 1, "logprobs": 3})
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["token_ids"] == [int(w.argmax())]
            for tok, lp in logprob_table(choice).items():
                assert abs(lp - float(w[tok])) <= TOL, (tok, lp, float(w[tok]))
            if len(p) > 32:
                assert choice["prefill"]["chunks"] >= 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=10)
        assert "draining 0 request(s) in flight" in "".join(lines) and proc.returncode == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ep_flag_errors(capsys):
    from cpgraph.cli import main

    assert main(["serve", "--model", "tiny-glm5", "--cp", "2", "--ep", "4", "--backend", "aot_eager"]) == 2
    err = capsys.readouterr().err
    assert "--ep must be 1 or equal to --cp (2)" in err and err.count("\n") == 1, err
    assert main(["serve", "--model", "tiny-glm5", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ep must be 1 or equal to --cp (1)" in err and err.count("\n") == 1, err

"""``cpgraph launch`` under torchrun: environment and layout checks, DP x CP groups across "nodes" on loopback.

The slow tests start real ``torchrun`` jobs (gloo on the CPU, ``aot_eager``)
and compare every prompt's logits with a single-device run of the same batch
the group computed.  Everything binds to 127.0.0.1 and runs under a timeout.
Starting ranks and compiling is what they cost, so one job of four "nodes"
(one rank each: two CP groups of two, each across two nodes) serves both the
data-parallel and the multi-node test.  The failing-input test needs no
compile: its two ranks get the environment torchrun gives the ranks of a
node and fork from the suite's fork server (``run_ranks``), which spares
each the seconds of importing torch and the compiler.
Their model is a local checkpoint of tiny-glm5 cut to two layers (a dense
layer with its indexer, a MoE layer sharing its top-k): every rank compiles
it, and compile time grows with the layers; the bundled-name path is what
the CLI error tests use.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import DSAConfig, build_model, from_pretrained, init_random, prefill_logits
from cpgraph.models.config import bundled_config_dict
from cpgraph.runtime import launch
from cpgraph.runtime.inputs import InputError, builtin_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import _context as _fork_server_context, rank_threads  # noqa: E402

ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
JOB_TIMEOUT = 600  # seconds a whole torchrun job may take on a loaded 2-core machine


# ----------------------------------------------------------------------------- environment


def test_read_env_reads_all_five():
    env = launch.read_env(ENV)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (0, 2, 0, "127.0.0.1", 29500)


def test_missing_rendezvous_variable_is_named():
    env = dict(ENV)
    del env["MASTER_ADDR"]
    with pytest.raises(InputError, match=r"^rendezvous variable\(s\) MASTER_ADDR not set"):
        launch.read_env(env)
    with pytest.raises(InputError, match="none of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT is set"):
        launch.read_env({})


@pytest.mark.parametrize("key,value,msg", [
    ("RANK", "x", "RANK must be an integer"),
    ("RANK", "2", r"RANK=2 is outside \[0, WORLD_SIZE=2\)"),
    ("WORLD_SIZE", "0", "WORLD_SIZE must be >= 1"),
    ("LOCAL_RANK", "1", r"LOCAL_RANK=1 must be in \[0, RANK=0\]"),
    ("MASTER_PORT", "70000", "MASTER_PORT must be a TCP port"),
])
def test_bad_rendezvous_values(key, value, msg):
    with pytest.raises(InputError, match=msg):
        launch.read_env(dict(ENV, **{key: value}))


def test_only_local_rank_zero_reports_shared_errors():
    assert launch.reports_errors(ENV)
    assert not launch.reports_errors(dict(ENV, RANK="1", LOCAL_RANK="1"))
    assert launch.reports_errors({"LOCAL_RANK": "1"})  # a broken environment: every process says so


# ----------------------------------------------------------------------------- layout


def test_layout_maps_ranks_to_groups_and_experts():
    lay = launch.rank_layout(8, cp=4, ep=4, num_experts=16)
    assert lay.dp == 2
    assert [lay.group_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.group_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert lay.group_ranks(1) == [4, 5, 6, 7]
    assert [lay.expert_range(r, 16) for r in (0, 3, 4)] == [(0, 4), (12, 16), (0, 4)]
    assert launch.rank_layout(8, cp=4, ep=1).expert_range(5, 16) == (0, 16)


@pytest.mark.parametrize("world,cp,ep,experts,msg", [
    (6, 4, 1, 8, "world size 6 is not divisible by --cp 4"),
    (8, 4, 2, 8, r"--ep must be 1 or equal to --cp \(4\)"),
    (8, 4, 4, 6, "--ep 4 does not divide the model's 6 routed experts"),
    (8, 0, 1, 8, "--cp must be >= 1"),
])
def test_layout_refusals(world, cp, ep, experts, msg):
    with pytest.raises(InputError, match=msg):
        launch.rank_layout(world, cp=cp, ep=ep, num_experts=experts)


@pytest.mark.parametrize("ep", [1, 2])
def test_ep_reaches_the_compiler_config(ep):
    """--ep is accepted and every rank compiles with it: an EP rank holds E/ep experts and needs the dispatch."""
    layout = launch.rank_layout(4, cp=2, ep=ep, num_experts=8)
    cfg = launch.compiler_config(layout, "g1")
    assert (cfg.group_name, cfg.cp_size, cfg.ep) == ("g1", 2, ep)
    assert "compact_moe_rows" not in cfg.disabled_passes  # the pass that inserts the dispatch runs


def test_ep_needs_the_dispatch_in_the_compiled_graph(caplog):
    """EP ranks hold E/ep experts: a graph without cpgraph::moe_dispatch would silently drop routes."""
    from collections import Counter
    from types import SimpleNamespace

    without = SimpleNamespace(history=[("compact_moe_rows", Counter(), Counter({"cpgraph.moe_experts.default": 3}))])
    with_dispatch = SimpleNamespace(history=[("ep", Counter(), Counter({"cpgraph.moe_dispatch.default": 3}))])
    launch.check_expert_parallel_graph(without, 1)  # nothing to check without EP
    launch.check_expert_parallel_graph(with_dispatch, 2)
    with pytest.raises(InputError, match=r"--ep 2: the compiled graph has no expert-parallel dispatch"):
        launch.check_expert_parallel_graph(without, 2)
    launch.check_expert_parallel_graph(SimpleNamespace(history=[]), 2)  # cache hit: logged, not checked
    assert "could not be checked" in caplog.text


def test_round_robin_and_per_group_files(tmp_path):
    assert launch.round_robin(5, 2) == [[0, 2, 4], [1, 3]]
    with pytest.raises(InputError, match="1 prompt.* for 2 data-parallel groups"):
        launch.round_robin(1, 2)
    (tmp_path / "b0.json").write_text(json.dumps([[1, 2], [3]]))
    (tmp_path / "b1.json").write_text(json.dumps([[4, 5, 6]]))
    spec = launch.LaunchSpec(model="tiny-glm5", prompts_file=str(tmp_path / "b{group}.json"))
    assert launch.group_prompts(spec, 2, 0, 512) == ([0, 1], [[1, 2], [3]], [0, 0])
    assert launch.group_prompts(spec, 2, 1, 512) == ([2], [[4, 5, 6]], [0])
    spec.prefix_lens = [0, 0]
    with pytest.raises(InputError, match="--prefix-lens applies to one prompts file"):
        launch.group_prompts(spec, 2, 0, 512)
    one = launch.LaunchSpec(model="tiny-glm5", prompts_file=str(tmp_path / "b0.json"), prefix_lens=[16, 0])
    assert launch.group_prompts(one, 2, 1, 512) == ([1], [[3]], [0])


# ----------------------------------------------------------------------------- CLI errors (no rank started)


def _one_line_exit_2(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpgraph launch: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("env,argv,msg", [
    ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, [], "MASTER_ADDR not set"),
    ({}, [], "none of RANK"),
    (dict(ENV, WORLD_SIZE="3"), ["--cp", "2"], "world size 3 is not divisible by --cp 2"),
    (ENV, ["--ep", "3", "--cp", "2"], r"--ep must be 1 or equal to --cp \(2\)"),
    (ENV, ["--model", "no-such-model"], "neither a local checkpoint directory nor a bundled model"),
    (ENV, ["--top", "0"], "--top must be >= 1"),
])
def test_launch_cli_errors_are_one_line(monkeypatch, capsys, env, argv, msg):
    for k in launch.RENDEZVOUS_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = ["launch", "--model", "tiny-glm5", "--device", "cpu"] + argv
    err = _one_line_exit_2(capsys, args)
    assert re.search(msg, err), err


# ----------------------------------------------------------------------------- torchrun jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]


def _job_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for k in launch.RENDEZVOUS_VARS:
        env.pop(k, None)
    return env


def _run_jobs(cmds: list[list[str]], cwd) -> list[subprocess.CompletedProcess]:
    """Start every command (one per "node"), wait for all under one timeout, kill their process groups on expiry."""
    procs = [subprocess.Popen(c, cwd=cwd, env=_job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c in cmds]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=JOB_TIMEOUT)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def _rank_main(target, rank: int, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(rank_threads())  # torchrun's OMP_NUM_THREADS=1 (the fork server read its environment)
    try:
        results.put((rank, True, target(*args)))
    except BaseException:  # noqa: BLE001  (report, never hang the test)
        results.put((rank, False, traceback.format_exc()))


def run_ranks(target, world: int, *args, timeout: float = JOB_TIMEOUT) -> list:
    """``target(*args)`` in ``world`` processes with the environment torchrun gives the ranks of one node.

    The processes fork from the suite's fork server (tests/dist_utils.py): torch and the compiler come imported,
    where a rank torchrun starts imports them first (seconds each).  Returns each rank's value in rank order;
    a rank that raises or does not answer within ``timeout`` fails the test (the others are killed).
    """
    ctx = _fork_server_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not answer") from None
            assert ok, f"rank {rank}:\n{value}"
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def cli(argv: list[str]) -> tuple[int, str, str]:
    """``cpgraph ARGV`` in this process: ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """tiny-glm5 with two layers (dense + indexer, MoE + shared top-k) as a local checkpoint directory."""
    from safetensors.torch import save_file

    config = dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=2)
    model = init_random(build_model(DSAConfig.from_hf_dict(config)), seed=0, std=config["initializer_range"])
    assert model.config.mlp_layer_types == ("dense", "sparse") and model.config.indexer_types == ("full", "shared")
    root = tmp_path_factory.mktemp("two_layer_glm5")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def _reference(checkpoint: str, tokens: list[list[int]]) -> torch.Tensor:
    return prefill_logits(from_pretrained(checkpoint), tokens)


def _launch_args(checkpoint: str, *extra: str) -> list[str]:
    return ["-m", "cpgraph", "launch", "--model", checkpoint, "--device", "cpu", "--backend", "aot_eager",
            "--timeout", "300", *extra]


PROMPTS = builtin_prompts(512)[:3] + [list(range(5, 60))]


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory, checkpoint):
    """One job, two tests: four torchrun invocations (``--nnodes 4``, one rank each) meet at a c10d rendezvous on
    127.0.0.1 and run ``--cp 2``: two data-parallel CP groups, each of them spanning two "nodes"."""
    root = tmp_path_factory.mktemp("four_nodes")
    (root / "p.json").write_text(json.dumps(PROMPTS))
    out = root / "out.json"
    port = _free_port()
    cmds = [_torchrun(port, "--nnodes", "4", "--node-rank", str(n), "--nproc-per-node", "1",
                      "--rdzv-conf", f"is_host={'true' if n == 0 else 'false'}")
            + _launch_args(checkpoint, "--cp", "2", "--prompts-file", "p.json", "--json", str(out)) for n in range(4)]
    results = _run_jobs(cmds, root)
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text()), results


@pytest.mark.slow
def test_torchrun_two_cp_groups_run_their_own_batches(four_nodes, checkpoint):
    """4 ranks, --cp 2: two data-parallel CP groups, each equal to one device on its own batch."""
    data, results = four_nodes
    assert (data["world_size"], data["dp"], data["cp"], data["ep"]) == (4, 2, 2, 1)
    assert data["tokens"] == PROMPTS
    groups = data["groups"]
    assert [g["ranks"] for g in groups] == [[0, 1], [2, 3]]
    assert [g["prompt_indices"] for g in groups] == [[0, 2], [1, 3]]  # round-robin: different batches
    assert all(g["ranks_agree"] for g in groups)
    logits = torch.tensor(data["logits"])
    for g in groups:
        idx = g["prompt_indices"]
        ref = _reference(checkpoint, [PROMPTS[i] for i in idx])
        torch.testing.assert_close(logits[idx], ref, rtol=0, atol=1e-5)
        assert sum(g["kv_bytes_per_rank"]) == g["replicated_bytes"]  # owner-sharded: each page stored once
    stdout = "".join(r.stdout for r in results)
    assert "world 4 = 2 data-parallel group(s) x CP 2 (EP 1) on cpu (aot_eager)" in stdout
    assert stdout.count("prompt ") == 4  # only global rank 0 prints results


@pytest.mark.slow
def test_nodes_on_loopback_form_cp_groups_across_nodes(four_nodes):
    """One rank per torchrun invocation: each CP group's two ranks come from two invocations ("nodes"), which
    met at one rendezvous; the groups agree and equal one device (above); exactly one process prints."""
    data, results = four_nodes
    assert len(results) == data["world_size"] == 4  # one rank per node: every group of 2 spans 2 nodes
    assert all(g["ranks_agree"] and len(g["ranks"]) == 2 for g in data["groups"])
    printed = [r for r in results if "world 4 = 2 data-parallel group(s)" in r.stdout]
    assert len(printed) == 1  # exactly one process (global rank 0) prints the results
    assert all("prompt " not in r.stdout for r in results if r is not printed[0])


@pytest.mark.slow
def test_bad_input_on_one_group_stops_every_rank_with_one_line(tmp_path, checkpoint):
    """Group 1's prompts file is broken: no rank waits for it in a collective; each node prints one line.

    The two ranks of one node, with torchrun's environment (``run_ranks``): each must return by itself.
    """
    (tmp_path / "b0.json").write_text(json.dumps([[1, 2, 3]]))
    (tmp_path / "b1.json").write_text(json.dumps([[1, 999999]]))
    argv = _launch_args(checkpoint, "--cp", "1", "--prompts-file", str(tmp_path / "b{group}.json"))[2:]
    ranks = run_ranks(cli, 2, argv)
    assert [rc for rc, _, _ in ranks] == [2, 2]
    stderr = "".join(err for _, _, err in ranks)
    lines = [ln for ln in stderr.splitlines() if ln.startswith("cpgraph launch: error:")]
    assert lines == ["cpgraph launch: error: rank 1: prompt 0, position 1: token 999999 is not an id in [0, 512) "
                     "(the model's vocabulary)"], stderr[-4000:]
    assert "cpgraph/runtime" not in stderr  # no traceback from a rank

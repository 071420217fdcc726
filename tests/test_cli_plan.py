"""The ``cpgraph`` command: readable output, JSON output, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

from cpgraph.cli import main
from cpgraph.plan import plan_prefill


def test_plan_command_prints_map(capsys):
    assert main(["plan", "--prefix", "0,128", "--extend", "1000,37", "--cp", "4", "--page", "64"]) == 0
    out = capsys.readouterr().out
    assert "req 0: prefix 0 (0 cached page(s)), extend 1000 (16 page(s), tail slack 24)" in out
    assert "p0-1->r0, p2-3->r1, p4-5->r2, p6-9->r3, p10-11->r2, p12-13->r1, p14-15->r0" in out
    assert "req 1: prefix 128 (2 cached page(s)), extend 37 (1 page(s), tail slack 27)" in out
    assert "last token (pos 164) on rank 0, row 268" in out
    assert "rank 3: 256 valid row(s): req0[pos 384-639]" in out
    assert "CP compute padding (dummy rows to equal M): 39 row(s) [0, 13, 13, 13] per rank" in out


def test_plan_command_json_round_trips(capsys):
    assert main(["plan", "--prefix", "0,64", "--extend", "70,1", "--cp", "2", "--page", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = plan_prefill([0, 64], [70, 1], cp_size=2, page_size=64)
    assert data == json.loads(json.dumps(plan.to_dict()))
    assert data["requests"][1]["last_token"] == {"rank": plan.last_token_owner(1)[0], "row": plan.last_token_owner(1)[1]}


def test_plan_command_errors_are_messages_not_tracebacks():
    proc = subprocess.run(
        [sys.executable, "-m", "cpgraph.cli", "plan", "--prefix", "0,100", "--extend", "5,5", "--page", "64"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "request 1: prefix length 100 is not a multiple of page_size 64" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_plan_command_bad_list_is_one_line(capsys):
    assert main(["plan", "--extend", "5,x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected comma-separated integers, got '5,x'" in err

"""Mooncake's own log follows the cpgraph logger: quiet by default, the engine's lines when verbose."""

import logging
import subprocess
import sys

import pytest

from cpgraph.transfer.engine import engine_log_level, mooncake_available, set_log_level


def test_level_mapping_and_user_setting_kept(monkeypatch):
    assert [engine_log_level(x) for x in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)] == \
        ["INFO", "WARNING", "ERROR", "ERROR"]
    monkeypatch.delenv("_CPGRAPH_MC_LOG_LEVEL", raising=False)
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")  # the user's own choice
    assert set_log_level(logging.WARNING) is None
    monkeypatch.delenv("MC_LOG_LEVEL")
    assert set_log_level(logging.DEBUG) == "INFO"
    assert set_log_level(logging.WARNING) == "ERROR"  # ours: may be changed again


_CHILD = """
import logging, sys
logging.getLogger("cpgraph").setLevel(int(sys.argv[1]))
from cpgraph.transfer.engine import MooncakeEngine
MooncakeEngine("127.0.0.1").close()
print("done", flush=True)
"""


@pytest.mark.skipif(not mooncake_available(), reason="the Mooncake transfer engine is not installed")
@pytest.mark.parametrize("level,quiet", [(logging.WARNING, True), (logging.DEBUG, False)])
def test_engine_process_output_follows_the_level(level, quiet):
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MC_LOG_LEVEL", "_CPGRAPH_MC_LOG_LEVEL")}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(level)], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0 and out.stdout.strip() == "done"
    if quiet:
        assert out.stderr == ""  # nothing at start-up, nothing at exit
    else:
        assert "transfer_engine" in out.stderr or "tcp_transport" in out.stderr

"""`pipeinfer serve` when things go wrong: a rank fails mid-request, a rank stops while the server
is idle, the port is taken."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from jobprocs import rank_process
from serving import start_server

pytestmark = pytest.mark.mpi


def test_a_failing_rank_gives_503_and_the_server_exits_nonzero(smollm2_path, tmp_path):
    """With no restart allowed (--max-restarts 0): test_serve_recovery.py has the restarts."""
    # Rank 1 raises on its 30th run: in the middle of the second request below.
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 512, "--max-restarts", 0,
                          log_dir=tmp_path, PIPEINFER_DEBUG_FAIL="1:30")
    try:
        ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100}
        status, body = server.post_json("/v1/chat/completions", {**ask, "mode": "pipeinfer"})
        assert status == 400 and body["error"]["param"] == "mode" and "needs a draft" in body["error"]["message"]
        status, body = server.post_json("/v1/chat/completions", {**ask, "max_tokens": 8})
        assert status == 200
        status, body = server.post_json("/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 100})
        msg = body["error"]["message"]
        assert status == 503 and "--max-restarts 0" in msg and "rank 1" in msg and "injected fault" in msg, msg
        rc = server.proc.wait(timeout=30)
    finally:
        server.stop()
    assert rc not in (0, None)
    log = server.stderr()
    assert "Error: rank 1: " in log and "injected fault" in log and "Traceback" not in log, log


def test_a_rank_stopped_while_the_server_is_idle_ends_it(smollm2_path, tmp_path):
    # No request is running: the idle head still reads the heartbeats and notices the silence.
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 512, "--rank-timeout", 3,
                          "--max-restarts", 0, log_dir=tmp_path)
    stopped = None
    try:
        status, _ = server.post_json("/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert status == 200
        stopped = rank_process(server.marker, 1)
        os.kill(stopped, signal.SIGSTOP)
        rc = server.proc.wait(timeout=60)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()
    assert rc not in (0, None)
    log = server.stderr()
    assert "Error: rank 1 (stage 2 of 2" in log and "sent nothing for 3 s" in log and "Traceback" not in log, log


def test_a_port_in_use_is_a_usage_error(smollm2_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "serve", str(smollm2_path), "--ranks", "2",
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == f"Error: port {port} on 127.0.0.1 is in use by another program; pass another --port"


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_is_a_clean_stop_on_one_rank_or_many(smollm2_path, tmp_path, ranks):
    """One wording and exit status 0, whether rank 0 serves alone or relaunched under mpiexec."""
    server = start_server(smollm2_path, "--ranks", ranks, "--threads", 1, "--ctx", 512, log_dir=tmp_path)
    try:
        status, _ = server.post_json("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(timeout=30)
    finally:
        server.stop()
    log = server.stderr()
    assert rc == 0, log
    assert log.splitlines()[-1] == "pipeinfer serve: stopped by SIGTERM", log
    assert "Error" not in log and "Traceback" not in log, log


def test_the_head_killed_ends_the_job_with_one_line_naming_it(smollm2_path, tmp_path):
    """Rank 0 killed by SIGKILL with no restart allowed: the front sees it at once (its channel
    closes), not after --rank-timeout: one line, status 1."""
    import time

    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 512, "--rank-timeout", 60,
                          "--max-restarts", 0, log_dir=tmp_path)
    try:
        killed_at = time.monotonic()
        os.kill(rank_process(server.marker, 0), signal.SIGKILL)
        rc = server.proc.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        server.stop()
    errors = [ln for ln in server.stderr().splitlines() if ln.startswith("Error: ")]
    assert rc == 1 and took < 30, (rc, took)
    assert len(errors) == 1 and errors[0].startswith("Error: rank 0 (the head") and "killed by SIGKILL" in errors[0], \
        server.stderr()

"""`pipeinfer serve` on emulated hosts (root): a rank killed on another host, or a host whose link is
taken down, is survived; every answer equals the fault-free one, and the host that no longer answers
is left out of the new job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from serving import Server, free_port, read_events, wait_ready
from test_emulated_cluster import _WHY, _up, _ID  # noqa: F401 - the cluster fixtures' helpers
from jobprocs import job_env

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

ASK = {"prompt": "Write a long story about a dragon who learns to code.", "max_tokens": 96, "temperature": 0.7,
       "seed": 5}


@pytest.fixture
def cluster3s():
    yield from _up(3, f"pt{_ID}s", rate="1gbit")


def _serve(emu, model: Path, log_dir: Path) -> Server:
    import uuid

    port, marker = free_port(), uuid.uuid4().hex
    log = log_dir / f"serve-{port}.err"
    cmd = emu.cmd("exec", "--", sys.executable, "-m", "pipeinfer_cli", "serve", str(model), "--port", str(port),
                  "--ranks", "3", "--threads", "1", "--ctx", "1024", "--rank-timeout", "6")
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                env=job_env(marker), start_new_session=True)
    server = Server(proc, marker, port, log, None, [])
    wait_ready(server)
    return server


def _streamed(server: Server, fault) -> str:
    _, resp = server.open_stream("/v1/completions", ASK)
    events = read_events(resp, 15)
    fault()
    text = ""
    for data in events + read_events(resp):
        if data != "[DONE]":
            d = json.loads(data)
            assert "error" not in d, d
            text += d["choices"][0]["text"]
    return text


def _wait_health(server: Server, want: dict, within_s: float = 120) -> None:
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            _, _, body = server.request("GET", "/health", timeout=5)
            if json.loads(body) == want:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health never said {want}: {server.stderr()}")


def _rank_pid(emu, rank: int) -> int:
    found = [p for p in emu.pids() if f"PMI_RANK={rank}\0".encode() in Path(f"/proc/{p}/environ").read_bytes()
             and Path(f"/proc/{p}/comm").read_text().strip() == "python"]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("fault", ["kill", "link-down"])
def test_serve_survives_a_lost_rank_on_another_host(smollm2_path, cluster3s, tmp_path, fault):
    emu = cluster3s
    server = _serve(emu, smollm2_path, tmp_path)
    try:
        _, reference = server.post_json("/v1/completions", ASK)
        if fault == "kill":
            answer = _streamed(server, lambda: os.kill(_rank_pid(emu, 2), signal.SIGKILL))
        else:
            down = ["ip", "netns", "exec", emu.host(1), "ip", "link", "set", "eth0", "down"]
            answer = _streamed(server, lambda: subprocess.run(down, check=True))
        assert answer == reference["choices"][0]["text"]
        _, _, body = server.request("GET", "/health")
        health = json.loads(body)
        if fault == "kill":
            assert health == {"status": "ok"}
        else:
            assert health == {"status": "degraded", "hosts_lost": [emu.host(1)]}
        _, again = server.post_json("/v1/completions", ASK)
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]
        if fault == "link-down":  # the host comes back; SIGHUP plans the job over every host again
            subprocess.run(["ip", "netns", "exec", emu.host(1), "ip", "link", "set", "eth0", "up"], check=True)
            server.proc.send_signal(signal.SIGHUP)
            _wait_health(server, {"status": "ok"})
            _, after = server.post_json("/v1/completions", ASK)
            assert after["choices"][0]["text"] == reference["choices"][0]["text"]
            # The last time the job started again, it served on every host (the request's summary
            # line may come before or after this look at the log).
            again_lines = [ln for ln in server.stderr().splitlines() if "serving again:" in ln]
            assert "serving again: 3 ranks" in again_lines[-1], server.stderr()
    finally:
        server.stop()
        subprocess.run(["ip", "netns", "exec", emu.host(1), "ip", "link", "set", "eth0", "up"], capture_output=True)
    log = server.stderr()
    restarts = [ln for ln in log.splitlines() if "starting the job again" in ln]
    assert len(restarts) == (1 if fault == "kill" else 2), log
    if fault == "kill":
        assert "rank 2 (stage 3 of 3, host " + emu.host(2) in restarts[0], log
    else:
        assert "rank 1 (stage 2 of 3, host " + emu.host(1) in restarts[0] and "on 2 ranks" in restarts[0], log
    assert "Traceback" not in log and "Error" not in log, log

"""`pipeinfer serve` outlives a lost rank: the front starts the job again and every request in flight
is finished from its committed tokens, with exactly the text of a run where nothing failed; requests
that waited just wait. Real SIGKILLs of ranks of a local job (no root needed)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from jobprocs import marked_pids, rank_process
from serving import read_events, start_server, wait_ready

pytestmark = pytest.mark.mpi

ASKS = [{"prompt": "Write a long story about a dragon who learns to code.", "max_tokens": 120, "temperature": 0.7,
         "seed": 5},
        {"messages": [{"role": "user", "content": "List twenty fruits, one per line."}], "max_tokens": 120},
        {"prompt": "def fibonacci(n):", "max_tokens": 80}]


def _path(ask: dict) -> str:
    return "/v1/chat/completions" if "messages" in ask else "/v1/completions"


def _text_of(events: list[str], chat: bool) -> tuple[str, str | None]:
    """The streamed text, and the error event's message if the stream ended with one."""
    text = ""
    for data in events:
        if data == "[DONE]":
            continue
        d = json.loads(data)
        if "error" in d:
            return text, d["error"]["message"]
        for c in d.get("choices", []):
            text += (c["delta"].get("content") or "") if chat else c.get("text", "")
    return text, None


def _answers(server, kill=None) -> list[str]:
    """Every ask at once, streamed; kill(events_seen) runs in the first stream after its 20th event."""
    results: list[tuple[str, str | None] | None] = [None] * len(ASKS)

    def run(i: int) -> None:
        ask = ASKS[i]
        _, resp = server.open_stream(_path(ask), ask)
        events = read_events(resp, 20) if i == 0 and kill is not None else []
        if events:
            kill()
        results[i] = _text_of(events + read_events(resp), "messages" in ask)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ASKS))]
    for t in threads:
        t.start()
        time.sleep(0.3)  # in this order: the first two run (--parallel 2), the third waits
    for t in threads:
        t.join(timeout=600)
    for r in results:
        assert r is not None and r[1] is None, results
    return [r[0] for r in results]


def _mapped_shm() -> set[Path]:
    """The MPICH shared-memory files some live process maps (another job running meanwhile)."""
    mapped = set()
    for entry in Path("/proc").iterdir():
        try:
            maps = (entry / "maps").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        mapped |= {Path(line.split()[-1]) for line in maps.splitlines() if "/dev/shm/mpich_shm_" in line}
    return mapped


def _metric(server, name: str) -> float:
    _, _, body = server.request("GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_new_rank(server, rank: int, old: int, within_s: float = 120) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            pid = rank_process(server.marker, rank)
            if pid != old:
                return pid
        except AssertionError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no new rank {rank}: {server.stderr()}")


def test_a_killed_stage_is_survived_with_the_same_answers(smollm2_path, tmp_path):
    args = ("--ranks", 3, "--threads", 1, "--ctx", 2048, "--parallel", 2, "--draft", "lookup", "--rank-timeout", 10)
    shm_before = set(Path("/dev/shm").glob("mpich_shm_*"))
    server = start_server(smollm2_path, *args, log_dir=tmp_path)
    try:
        reference = _answers(server)
        old = {r: rank_process(server.marker, r) for r in range(3)}
        answers = _answers(server, kill=lambda: os.kill(old[2], signal.SIGKILL))
        assert answers == reference
        _, _, body = server.request("GET", "/health")
        assert json.loads(body) == {"status": "ok"}
        assert _metric(server, "pipeinfer_restarts") == 1
        assert _metric(server, "pipeinfer_resumed_requests") >= 1
        # Nothing of the old job is left: its ranks are gone, the new job's are others.
        alive = set(marked_pids(server.marker))
        assert not (set(old.values()) & alive), (old, alive)
    finally:
        server.stop()
    # The killed rank could not remove its MPI shared memory: the front did, and the new job's.
    left = set(Path("/dev/shm").glob("mpich_shm_*")) - shm_before - _mapped_shm()  # not another running job's
    assert not left, left
    log = server.stderr()
    lines = [ln for ln in log.splitlines() if "starting the job again" in ln]
    assert len(lines) == 1 and "rank 2 (stage 3 of 3" in lines[0] and "SIGKILL" in lines[0], log
    assert "Traceback" not in log and "Error" not in log, log


def test_a_kill_during_the_restart_is_survived_too(smollm2_path, tmp_path):
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 1024, "--rank-timeout", 10,
                          log_dir=tmp_path)
    try:
        ask = ASKS[0]
        _, expected = server.post_json(_path(ask), ask)
        first = rank_process(server.marker, 1)

        def kill_twice() -> None:
            os.kill(first, signal.SIGKILL)
            os.kill(_wait_new_rank(server, 1, first), signal.SIGKILL)  # the new job, as it starts

        _, resp = server.open_stream(_path(ask), ask)
        events = read_events(resp, 20)
        kill_twice()
        text, error = _text_of(events + read_events(resp), False)
        assert error is None and text == expected["choices"][0]["text"]
        assert _metric(server, "pipeinfer_restarts") == 2
    finally:
        server.stop()


def test_past_max_restarts_every_client_is_told_and_the_server_exits_1(smollm2_path, tmp_path):
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 1024, "--max-restarts", 0,
                          log_dir=tmp_path)
    try:
        ask = ASKS[0]
        _, resp = server.open_stream(_path(ask), ask)
        events = read_events(resp, 10)
        os.kill(rank_process(server.marker, 1), signal.SIGKILL)
        _, error = _text_of(events + read_events(resp), False)
        rc = server.proc.wait(timeout=60)
    finally:
        server.stop()
    assert error is not None and "--max-restarts 0" in error, error
    assert rc == 1
    errors = [ln for ln in server.stderr().splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "rank 1 (stage 2 of 2" in errors[0] and "SIGKILL" in errors[0], server.stderr()


def test_health_answers_loading_while_the_profile_is_calibrated(smollm2_path, tmp_path):
    """The front binds and answers before anything slow: /health says "loading" while --parallel 2
    calibrates the profile of its default split (an empty cache: no profile cached yet)."""
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 1024, "--parallel", 2,
                          log_dir=tmp_path, wait=False, PIPEINFER_CACHE=str(tmp_path / "cache"))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.alive(), server.stderr()
            try:
                status, _, body = server.request("GET", "/health", timeout=5)
                log = server.stderr()
                break
            except OSError:
                time.sleep(0.02)
        assert status == 503 and json.loads(body) == {"status": "loading"}
        assert "split for 2 requests at once" not in log, log  # the calibration had not ended
        wait_ready(server)
        assert "split for 2 requests at once" in server.stderr()
    finally:
        server.stop()


def test_the_front_binds_where_it_runs_and_names_a_reachable_address(smollm2_path, tmp_path):
    """--host is bound by the command the user typed (the front), and with every interface the
    lines name this machine, not an address only the head's host could use."""
    import socket

    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 512, "--host", "0.0.0.0",
                          log_dir=tmp_path)
    try:
        with socket.create_connection((socket.gethostname(), server.port), timeout=5):
            pass
    finally:
        server.stop()
    log = server.stderr()
    name = socket.gethostname()
    assert f"listening on http://{name}:{server.port} (every interface);" in log, log
    assert f"ready: http://{name}:{server.port}/v1 " in log, log

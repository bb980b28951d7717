"""A real `pipeinfer serve` job in tests: start it (marked, in its own session, stderr to a file),
wait until /health says ok, talk to it over plain HTTP, and stop it with nothing left behind."""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from jobprocs import assert_no_survivors, job_env

LOAD_TIMEOUT_S = 180  # generous: the machine is shared


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    marker: str
    port: int
    log: Path
    api_key: str | None
    health_seen: list  # (status code, body) of every /health answer before "ok"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, auth: bool = True) -> dict:
        h = {"Content-Type": "application/json"}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def request(self, method: str, path: str, body: bytes | dict | None = None, auth: bool = True,
                headers: dict | None = None, timeout: float = 300) -> tuple[int, dict, bytes]:
        """(status, headers, body bytes) of one request."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, data, {**self.headers(auth), **(headers or {})})
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            c.close()

    def post_json(self, path: str, body: dict, **kw) -> tuple[int, dict]:
        status, _, raw = self.request("POST", path, body, **kw)
        return status, json.loads(raw)

    def open_stream(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        c.request("POST", path, json.dumps({**body, "stream": True}).encode(), self.headers())
        r = c.getresponse()
        assert r.status == 200, r.read()
        return c, r

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, within_s: float = 10) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = None
        assert_no_survivors(self.marker)
        return rc


_PROFILE_CACHE: list[Path] = []


def profile_cache() -> Path:
    """One cache directory for the servers of this test session: a server that calibrates (serve
    --parallel N on several ranks without a split does, once per job shape) keeps its profile there,
    for the session's next server, and never in the user's cache. The models are given by path."""
    if not _PROFILE_CACHE:
        path = Path(tempfile.mkdtemp(prefix="pipeinfer-test-serve-cache-"))
        atexit.register(shutil.rmtree, path, True)
        _PROFILE_CACHE.append(path)
    return _PROFILE_CACHE[0]


def start_server(model: Path | str, *args, log_dir: Path, api_key: str | None = None, wait: bool = True,
                 **env: str) -> Server:
    if isinstance(model, Path) or str(model).endswith(".gguf"):
        env.setdefault("PIPEINFER_CACHE", str(profile_cache()))
    port = free_port()
    marker = uuid.uuid4().hex
    log = log_dir / f"serve-{port}.err"
    cmd = [sys.executable, "-m", "pipeinfer_cli", "serve", str(model), "--port", str(port), *map(str, args)]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                env=job_env(marker, **env), start_new_session=True)
    server = Server(proc, marker, port, log, api_key, [])
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        if not server.alive():
            raise AssertionError(f"the server exited ({server.proc.returncode}): {server.stderr()}")
        try:
            status, _, body = server.request("GET", "/health", timeout=5)
        except OSError:  # not listening yet (mpiexec is starting the ranks)
            time.sleep(0.05)
            continue
        if status == 200:
            assert json.loads(body) == {"status": "ok"}
            return
        server.health_seen.append((status, json.loads(body)))
        time.sleep(0.05)
    server.stop()
    raise AssertionError(f"the server was not ready within {LOAD_TIMEOUT_S} s: {server.stderr()}")


def read_events(resp: http.client.HTTPResponse, n: int | None = None) -> list[str]:
    """The data of the next n server-sent events (all, until the stream ends, if n is None)."""
    out = []
    while n is None or len(out) < n:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            out.append(line[6:].decode().strip())
    return out


def run_generate(model: Path | str, *args, timeout: float = 300) -> dict:
    """`pipeinfer generate … --json` as a user runs it: the reference for the server's answers."""
    marker = uuid.uuid4().hex
    try:
        r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(model), *map(str, args), "--json"],
                           capture_output=True, text=True, timeout=timeout, env=job_env(marker))
    finally:
        assert_no_survivors(marker)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)

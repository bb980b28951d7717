"""A `pipeinfer serve` job for `bench --concurrency`: started as a child command on a free localhost
port, waited for (GET /health), and stopped with nothing left behind.

The server is the ordinary `pipeinfer serve` command (this Python, `-m pipeinfer_cli serve …`),
started through transport/launch.py, so it launches its own ranks (`--ranks N`: its relaunch under
mpiexec) and stops them in order on SIGTERM, as when a user stops it. It runs in a session of its own, so a Ctrl-C at the terminal
reaches only the bench, which then stops the server; if the bench dies without stopping it, the
server gets SIGTERM from the kernel (transport/launch.py's parent-death signal). A server that does
not end within ORDERLY_STOP_S + STOP_WAIT_S of SIGTERM is stopped by force, every process of its
tree (transport/process_tree.JobProcesses, as `--ranks` jobs are).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import PipeinferError
from ..transport.launch import pipeinfer_command, start_own_session
from ..transport.process_tree import JobProcesses

HOST = "127.0.0.1"
READY_TIMEOUT_S = 900.0  # loading a large model on a shared machine takes minutes
POLL_S = 0.1
# serve ends every request, then its job (which gets 5 s before it is stopped by force: server/front.py);
# past this, the server is stopped by force.
ORDERLY_STOP_S = 5.0
STOP_WAIT_S = 10.0  # beyond serve's own orderly stop (ORDERLY_STOP_S), before the force


class ServerFailed(PipeinferError):
    """The server exited or did not become ready; the message carries its own error line."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerJob:
    """One `pipeinfer serve` child process and its log file (its stderr)."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, argv: list[str]):
        self.proc, self.port, self.log, self.argv = proc, port, log, argv
        self.stopped_rc: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @classmethod
    def start(cls, serve_args: list[str], port: int | None = None) -> ServerJob:
        """`pipeinfer serve SERVE_ARGS --host 127.0.0.1 --port PORT`, stdout dropped, stderr to a log file."""
        port = port or free_port()
        argv = ["serve", *serve_args, "--host", HOST, "--port", str(port)]
        fd, log = tempfile.mkstemp(prefix="pipeinfer-bench-serve-", suffix=".log")
        try:
            proc = start_own_session(pipeinfer_command(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=fd)
        except BaseException:
            os.close(fd)
            os.unlink(log)
            raise
        os.close(fd)
        return cls(proc, port, Path(log), argv)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def health(self, timeout: float = 5.0) -> tuple[int, dict] | None:
        """(status, body) of GET /health; None while nothing listens."""
        c = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            c.request("GET", "/health")
            r = c.getresponse()
            body = r.read()
            try:
                return r.status, json.loads(body)
            except ValueError:
                return r.status, {"status": body.decode(errors="replace")}
        except OSError:
            return None
        finally:
            c.close()

    def wait_ready(self, on_status: Callable[[str, float], None] | None = None,
                   timeout_s: float = READY_TIMEOUT_S, every_s: float = 10.0) -> float:
        """Until /health says ok; on_status(status, elapsed) when the status changes and every
        `every_s` seconds meanwhile. Returns the seconds it took; ServerFailed if the server exited
        or did not become ready in time."""
        t0 = time.monotonic()
        last, last_said = None, t0
        while True:
            elapsed = time.monotonic() - t0
            if not self.alive():
                raise self.failure(f"the server exited (status {self.proc.returncode}) before it was ready")
            answer = self.health()
            status = "starting" if answer is None else str(answer[1].get("status", answer[0]))
            if answer is not None and answer[0] == 200 and status == "ok":
                return elapsed
            if answer is not None and status == "error":
                raise self.failure(f"the server failed while loading: {answer[1].get('message')}")
            now = time.monotonic()
            if on_status and (status != last or now - last_said >= every_s):
                on_status(status, elapsed)
                last, last_said = status, now
            if elapsed > timeout_s:
                raise self.failure(f"the server was not ready within {timeout_s:.0f} s (last /health: {status})")
            time.sleep(POLL_S)

    def check_alive(self) -> None:
        if not self.alive():
            raise self.failure(f"the server exited (status {self.proc.returncode}) during the benchmark")

    def error_line(self) -> str | None:
        """The server's last `Error: …` line, if it printed one."""
        with contextlib.suppress(OSError):
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.startswith("Error:")]
            return lines[-1] if lines else None
        return None

    def failure(self, what: str) -> ServerFailed:
        said = self.error_line()
        rc = self.proc.returncode
        return ServerFailed(f"{what}" + (f"; it said: {said.removeprefix('Error: ')}" if said else "")
                            + f" (its log: {self.log}; command: pipeinfer {' '.join(self.argv)})",
                            exit_code=2 if rc == 2 else 1)

    def stop(self) -> int | None:
        """SIGTERM (serve's orderly stop: requests in flight end with an error, every rank exits),
        by force after ORDERLY_STOP_S + STOP_WAIT_S. Returns the server's exit status."""
        if self.stopped_rc is not None:
            return self.stopped_rc
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=ORDERLY_STOP_S + STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            job = JobProcesses(self.proc)
            job.stop()  # SIGTERM to every process of its tree, SIGKILL soon after
            rc = job.finish()
        self.stopped_rc = rc
        return rc

    def remove_log(self) -> None:
        with contextlib.suppress(OSError):
            self.log.unlink()

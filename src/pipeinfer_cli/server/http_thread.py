"""uvicorn in a thread of its own, on a socket bound before the models load.

The head's main thread is the pipeline thread (every MPI call stays there); the ASGI event loop
runs here. Binding first means a port in use is reported at once, as a usage error, and /health
answers "loading" while the models load.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

from ..errors import UsageError


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a UsageError that says what to change."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} is not an address of this machine ({e.strerror}); "
                         "use 127.0.0.1, 0.0.0.0 or a local address") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use by another program; pass another --port") from None
        if e.errno == errno.EACCES:
            raise UsageError(f"no permission to listen on port {port}; use a port above 1023") from None
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


class HttpThread:
    """Serve an ASGI app on a bound socket in a daemon thread; stop() ends it."""

    def __init__(self, app, sock: socket.socket):
        import uvicorn

        self.app = app
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.sock = sock
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")

    def stop(self, timeout_s: float = 5.0, drain_s: float = 2.0) -> None:
        """Let answers in flight write their last event (the service has ended them) for up to
        drain_s, then shut the server down."""
        in_flight = getattr(self.app.state, "answers_in_flight", lambda: 0)
        deadline = time.monotonic() + drain_s
        while in_flight() > 0 and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.server.should_exit = True
        self.thread.join(timeout_s)

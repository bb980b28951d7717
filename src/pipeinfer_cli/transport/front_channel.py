"""The channel between `pipeinfer serve`'s front (the HTTP server, not an MPI rank) and the head of
the job it started: one authenticated connection, messages in order.

The front listens on an ephemeral TCP port and hands the job its address and a random key through
the environment (FRONT_ENV, FRONT_KEY_ENV), which the launcher passes to every rank; the head (rank
0) connects back. multiprocessing's connection does the framing and a challenge-response on the key
(HMAC), so only the job the front started can talk to it. Messages are tuples whose first item says
what they are:

front -> head: ("submit", id, GenerationRequest), ("cancel", id), ("slots", nonce), ("stop", reason)
head -> front: ("ready", EngineInfo), ("event", id, Event), ("slots", nonce, rows), ("failed", message)

A closed connection is an answer too: the front takes it as the job lost, the head as the front
gone (it stops the job).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

FRONT_ENV = "PIPEINFER_FRONT"  # host:port the head connects to
FRONT_KEY_ENV = "PIPEINFER_FRONT_KEY"  # the key, hex
CONNECT_TIMEOUT_S = 20.0


class ChannelClosed(Exception):
    """The other end went away (its process ended, or the connection broke)."""


class Channel:
    """One end of the connection: send from any thread, receive on one."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, *message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, EOFError, ValueError) as exc:
                self.closed = True
                raise ChannelClosed(str(exc)) from None

    def recv(self, timeout: float | None = None) -> tuple | None:
        """The next message; None if none came within `timeout` s; ChannelClosed at the end."""
        try:
            if timeout is not None and not self._conn.poll(timeout):
                return None
            return self._conn.recv()
        except (OSError, EOFError, ValueError) as exc:
            self.closed = True
            raise ChannelClosed(str(exc) or "closed") from None

    def close(self) -> None:
        self.closed = True
        try:
            self._conn.close()
        except OSError:
            pass


class FrontListener:
    """The front's end: a port the head of each job it starts connects to."""

    def __init__(self, connect_host: str = "127.0.0.1"):
        self.key = secrets.token_bytes(32)
        bind_host = "127.0.0.1" if connect_host == "127.0.0.1" else "0.0.0.0"
        self._listener = Listener((bind_host, 0), authkey=self.key)
        self.address = (connect_host, self._listener.address[1])

    def env(self) -> dict[str, str]:
        """What the job's ranks need in their environment to connect back."""
        host, port = self.address
        return {FRONT_ENV: f"{host}:{port}", FRONT_KEY_ENV: self.key.hex()}

    def accept(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> Channel | None:
        """The next head's connection, or None after `timeout` s or once give_up() is true (its job
        ended). A connection that fails the key is dropped and waited past."""
        sock = self._listener._listener._socket  # noqa: SLF001 - a timeout on accept, so a dead job is noticed
        deadline = _now() + timeout
        while _now() < deadline and not give_up():
            sock.settimeout(0.25)
            try:
                return Channel(self._listener.accept())
            except (OSError, EOFError, AuthenticationError):  # a timeout, or a caller without the key
                continue
        return None

    def close(self) -> None:
        self._listener.close()


def connect_to_front(environ=os.environ) -> Channel | None:
    """The head's end, if this job was started by a front (None otherwise)."""
    where = environ.get(FRONT_ENV)
    if not where:
        return None
    host, _, port = where.rpartition(":")
    key = bytes.fromhex(environ.get(FRONT_KEY_ENV, ""))
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(CONNECT_TIMEOUT_S)
    try:
        conn = Client((host, int(port)), authkey=key)
    except OSError as exc:
        from ..errors import PipeinferError

        raise PipeinferError(f"the head cannot reach the server's front at {host}:{port} ({exc.strerror or exc}); "
                             "check that the head's host can open TCP connections to the machine serve runs on") from None
    finally:
        socket.setdefaulttimeout(old)
    return Channel(conn)


def address_towards(host: str | None) -> str:
    """The address of this machine that `host` can reach it at: loopback when the host is this
    machine (or unknown), else the source address the kernel routes towards it."""
    if not host or host in ("localhost", socket.gethostname()):
        return "127.0.0.1"
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return socket.gethostname()
    if target.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((target, 9))  # no packet is sent: this only asks the routing table
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
    finally:
        probe.close()


def _now() -> float:
    import time

    return time.monotonic()

"""The head of a job that `pipeinfer serve`'s front started: requests arrive over the front channel
(transport/front_channel.py) instead of HTTP, and every event of every request goes back over it.

The front holds the queue, the clients and each request's committed tokens (server/front.py); this
side runs them on the pipeline with the service of runtime/service.py, exactly as a server on rank
0 does, so a request gets the same tokens either way. When the job fails (a rank lost), the head
says so once ("failed") and ends: the front, not the head, decides what the clients see.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..transport.front_channel import Channel, ChannelClosed
from ..planner.job_plan import JobPlan
from ..planner.job_config import JobConfig
from .parallel import SlotRow, slot_rows
from .service import Service
from .service_request import Event, InvalidRequest, ServiceUnavailable


@dataclass(frozen=True)
class EngineInfo:
    """What the front learns once the job has loaded: the configuration every rank runs with, how
    each rank is named in messages (rank, role, host), its layers and threads, and the hosts."""

    cfg: JobConfig
    rank_names: list[str]
    ranks: list[str]  # "0 head (0-14, 1 thread)", as the banner lists them
    hosts: list[str]
    default_mode: str


def describe_ranks(topo) -> list[str]:
    """Each rank as a server's banner lists it: '0 head (0-14, 1 thread)'."""
    from ..wording import plural
    from ..planner.layout import format_layer_ranges

    return [f"{r.rank} {r.role} ({format_layer_ranges([r.layers])}, {plural(r.threads, 'thread')})" for r in topo.ranks]


def serve_engine(plan: JobPlan, service: Service, channel: Channel) -> None:
    """Run on every rank of the job (the head passes its service and channel; the other ranks serve
    the pipeline): the front's requests until it says stop or goes away. A rank's failure is sent to
    the front ("failed") and raised."""
    from ..errors import describe
    from .job import run_service

    bridge = _Bridge(service, channel)
    service.on_ready = bridge.ready
    try:
        run_service(plan, service, before_load=bridge.start)
    except BaseException as exc:
        bridge.failed(describe(exc))
        raise
    finally:
        bridge.done.set()
        channel.close()


class _Bridge:
    """Forwards the front's messages to the service (a thread of its own) and the service's events to
    the front (from the pipeline thread)."""

    def __init__(self, service: Service, channel: Channel):
        self.service, self.channel = service, channel
        self.tickets: dict[int, object] = {}
        self.done = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="front-channel").start()

    def ready(self, service: Service) -> None:
        from ..transport.startup import job_startup
        from .job import rank_names

        topo, hosts = service.loaded.topo, job_startup().hosts
        info = EngineInfo(service.cfg, rank_names(topo, hosts), describe_ranks(topo), list(hosts),
                          service.default_mode())
        self._send("ready", info)

    def failed(self, message: str) -> None:
        self._send("failed", message)

    def _send(self, *message) -> None:
        try:
            self.channel.send(*message)
        except ChannelClosed:
            self.service.stop("the server's front went away")

    def _read(self) -> None:
        while not self.done.is_set():
            try:
                message = self.channel.recv(timeout=0.5)
            except ChannelClosed:
                self.service.stop("the server's front went away")
                return
            if message is None:
                continue
            kind = message[0]
            if kind == "submit":
                self._submit(message[1], message[2])
            elif kind == "cancel" and (ticket := self.tickets.get(message[1])) is not None:
                ticket.cancel()
            elif kind == "slots":
                self._send("slots", message[1], self._slot_rows())
            elif kind == "stop":
                self.service.stop(message[1])
                return

    def _slot_rows(self) -> list[SlotRow]:
        """GET /slots as the front's clients see it: requests named by the front's ids."""
        front_id = {ticket.seq: request_id for request_id, ticket in list(self.tickets.items())}
        rows = slot_rows(self.service)
        for row in rows:
            if "id_task" in row:
                row["id_task"] = front_id.get(row["id_task"], row["id_task"])
            held = row.get("draft_model_held_by")
            if isinstance(held, dict) and "id_task" in held:
                held["id_task"] = front_id.get(held["id_task"], held["id_task"])
        return rows

    def _submit(self, request_id: int, request) -> None:
        def on_event(event: Event) -> None:
            if event.kind in ("done", "error"):
                self.tickets.pop(request_id, None)
            self._send("event", request_id, event)

        try:
            self.tickets[request_id] = self.service.submit(request, on_event)
        except (InvalidRequest, ServiceUnavailable) as exc:
            self._send("event", request_id, Event("error", text=str(exc), reason="refused"))

"""The requests of `pipeinfer serve`'s front (server/front.py) on their way to the job's head and
back: which are with the head, the tokens whose text each client has received (what a resumed
request replays), cancellations, and GET /slots answered by the head."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..runtime.parallel import SlotRow, slot_rows
from ..runtime.service import Service
from ..runtime.service_request import Event, Ticket
from ..transport.front_channel import Channel, ChannelClosed

LOST_REASONS = ("failed", "stopping")  # a request's error that means its job ended, not the request


class RequestRouter:
    """Hands waiting requests to the head (up to --parallel at a time, each with the tokens it had
    committed) and routes the head's events back to their clients."""

    def __init__(self, service: Service, stats, stopping: Callable[[], bool]):
        self.service, self.stats, self.stopping = service, stats, stopping
        self.lock = threading.Lock()
        self.channel: Channel | None = None  # the current job's head; None while there is none
        self._outstanding: dict[int, Ticket] = {}  # handed to the head, not finished
        self._committed: dict[int, list[int]] = {}  # per ticket: tokens whose text its client received
        self._cancel_sent: set[int] = set()
        self._changed = threading.Event()  # a request finished or a head attached: the dispatcher looks now
        self._nonces = itertools.count(1)
        self._slot_asks: dict[int, threading.Event] = {}  # GET /slots waiting for the head's rows
        self._slot_answers: dict[int, list[SlotRow]] = {}

    def start(self) -> None:
        threading.Thread(target=self.dispatch, daemon=True, name="front-dispatch").start()

    def attach(self, channel: Channel | None) -> Channel | None:
        """The new job's head (None: the job is gone); returns the previous channel."""
        with self.lock:
            previous, self.channel = self.channel, channel
            self._changed.set()
            return previous

    def take_running(self) -> list[Ticket]:
        """The requests the head had (it is gone): they are the caller's now."""
        with self.lock:
            running = list(self._outstanding.values())
            self._outstanding.clear()
            self._cancel_sent.clear()
            self.service.slot_info.clear()
        return running

    def committed(self, ticket: Ticket) -> list[int]:
        return self._committed.get(ticket.seq, [])

    def slot_answer(self, nonce: int, rows: list[SlotRow]) -> None:
        self._slot_answers[nonce] = rows
        if (asked := self._slot_asks.pop(nonce, None)) is not None:
            asked.set()

    def dispatch(self) -> None:
        """Hand waiting requests to the head, up to --parallel at a time; pass on cancellations."""
        service = self.service
        while not self.stopping() or self._outstanding:
            channel = self.channel
            with self.lock:
                for seq, ticket in list(self._outstanding.items()):
                    if ticket.cancelled and seq not in self._cancel_sent and channel is not None:
                        self._cancel_sent.add(seq)
                        self.send(channel, "cancel", seq)
                free = len(self._outstanding) < service.parallel
            if channel is None or channel.closed or service.status != "ok" or not free:
                self._changed.wait(0.05)  # a slot freed, or a new head: at once; else look again soon
                self._changed.clear()
                continue
            ticket = service.take_parallel(timeout=0.2)
            if ticket is None:
                continue
            with self.lock:
                if channel is not self.channel or channel.closed:  # lost meanwhile: it waits for the next job
                    service.requeue([ticket])
                    continue
                committed = self._committed.setdefault(ticket.seq, [])
                request = replace(ticket.request, resume=list(ticket.request.resume) + committed)
                self._outstanding[ticket.seq] = ticket
                self._take_slot(ticket)
                if committed:
                    self.stats.resumed_requests += 1
                self.send(channel, "submit", ticket.seq, request)

    def send(self, channel: Channel, *message) -> None:
        try:
            channel.send(*message)
        except ChannelClosed:
            pass  # the main loop sees the job lost and hands the request out again

    def event(self, seq: int, event: Event) -> None:
        with self.lock:
            ticket = self._outstanding.get(seq)
        if ticket is None:
            return
        if event.kind == "text":
            with self.lock:
                self._committed.setdefault(seq, []).extend(event.tokens)
            ticket.n_tokens += len(event.tokens)
            if ticket.t_first_token is None:
                ticket.t_first_token = time.monotonic()
            ticket.emit(Event("text", text=event.text))
            return
        if event.kind == "error" and event.reason in LOST_REASONS and not self.stopping():
            return  # the job is ending; the request is resumed on the next one
        with self.lock:
            self._outstanding.pop(seq, None)
            self._committed.pop(seq, None)
            self._cancel_sent.discard(seq)
            self._free_slot(ticket)
        self._changed.set()
        if event.kind == "done":
            self.service._finish(ticket, event.result)  # noqa: SLF001 - the observers (metrics, the log line) too
        else:
            ticket.emit(event)
        self.service.release(ticket)

    def slot_rows(self, timeout_s: float = 2.0) -> list[SlotRow]:
        """GET /slots: the head's rows (which request holds the draft model, …), asked over the
        channel; while there is no pipeline, or if the head does not answer in time, the front's own
        view (which request runs in which slot)."""
        channel = self.channel
        if channel is not None and not channel.closed and self.service.status == "ok":
            nonce = next(self._nonces)
            asked = self._slot_asks[nonce] = threading.Event()
            self.send(channel, "slots", nonce)
            if asked.wait(timeout_s):
                return self._slot_answers.pop(nonce)
            self._slot_asks.pop(nonce, None)
        return slot_rows(self.service)

    def _take_slot(self, ticket: Ticket) -> None:
        """GET /slots: the request occupies the lowest free slot while the head runs it."""
        info = self.service.slot_info
        slot = next(i for i in range(len(info) + 1) if i not in info)
        info[slot] = {"ticket": ticket, "mode": ticket.request.mode or self.service.default_mode(),
                      "n_prompt_tokens": len(ticket.request.prompt)}

    def _free_slot(self, ticket: Ticket) -> None:
        info = self.service.slot_info
        for slot, row in list(info.items()):
            if row.get("ticket") is ticket:
                del info[slot]

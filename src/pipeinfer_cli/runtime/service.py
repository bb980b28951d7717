"""A generation service on the head: models loaded once, many clients.

With `--parallel 1` the pipeline runs one request at a time (PipeInfer accelerates a single
request); with `--parallel N` up to N requests generate at once, each in its own KV slot, their
runs interleaved in the pipeline (runtime/parallel.py). The others wait in a FIFO queue of bounded
length. The service knows nothing of HTTP: a client (the HTTP
server in `server/`, or a terminal chat) calls `submit()` from any thread and receives its
request's `Event`s through a callback, called from the pipeline thread. The pipeline thread — the
one thread that makes MPI calls on the head — runs `job.run_service(cfg, service)`, which feeds
`requests()` to `head.serve_requests` like any list of requests.

Python API (what `pipeinfer serve` uses; a terminal chat can use the same):

    service = Service(max_queue=8)
    # in the pipeline thread (rank 0 of the MPI job; the other ranks run it too and serve):
    run_service(cfg, service)                 # returns once service.stop() was called
    # in any other thread, once service.status == "ok":
    prompt = service.tokenize(messages=[{"role": "user", "content": "Hi"}])
    ticket = service.submit(GenerationRequest(prompt, mode="pipeinfer", n_predict=64), on_event)
    # on_event(Event("text", text=…)) as text is committed, then one Event("done", result=…)
    # (a GenerationResult) or one Event("error", text=…); ticket.cancel() ends it early.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

from ..decode.result import GenerationResult
from .head import Callbacks
from ..planner.job_config import JobConfig
from .job_config import Request
from .loaded import Loaded
from .loading import spec_margin
from .service_request import (  # noqa: F401 - part of this module's API
    Event, GenerationRequest, InvalidRequest, RequestTooLong, ServiceUnavailable, Ticket)
from ..decode.metrics import now
from ..decode.session import DecodeOptions
from ..decode.modes import MODE_NAMES as MODES, default_mode, needs_draft


class Service:
    """The FIFO queue between clients and the pipeline thread, and the service's status.

    status: "loading" until the models are loaded, then "ok"; "failed" once a rank failed (message
    says why), "stopping" once stop() was called.
    """

    def __init__(self, max_queue: int = 8, mode: str | None = None, on_ready: Callable[[Service], None] | None = None,
                 parallel: int = 1):
        self.max_queue = max_queue  # requests that may wait behind the ones being generated
        self.parallel = parallel  # requests generated at once
        self.mode = mode  # for requests that name none (None: pipeinfer with a draft, else iterative)
        self.on_ready = on_ready
        self.status = "loading"
        self.message = "loading the model"
        self.cfg: JobConfig | None = None  # set by attach() before serving
        self.loaded: Loaded | None = None
        self._cond = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._current: Ticket | None = None  # --parallel 1: the request being generated
        self._running: dict[int, Ticket] = {}  # --parallel N: the requests generating, by ticket seq
        self.slot_info: dict[int, dict] = {}  # --parallel N: slot -> what it does (GET /slots)
        self._seq = 0
        self._runs = 0  # requests taken off the queue so far
        self._observers: list[Callable[[Ticket, GenerationResult], None]] = []
        # The settings of requests that bring none (-M auto's, planned again as the server runs:
        # cli/serve_cmd.py); None: the job's.
        self.default_decode: Callable[[], DecodeOptions] | None = None
        # Called every half second on the pipeline thread while no request runs: it reads the
        # other ranks' heartbeats (which would pile up unread) and raises if a rank stopped
        # answering, so an idle server notices a dead rank too (run_service sets it).
        self.idle_check: Callable[[], None] | None = None

    def add_observer(self, fn: Callable[[Ticket, GenerationResult], None]) -> None:
        """fn(ticket, result) after every request that ran, cancelled ones included (pipeline thread)."""
        self._observers.append(fn)

    # -- what clients call (any thread) ---------------------------------------------------------
    @property
    def tokenizer(self):
        return self.loaded.tokenizer if self.loaded is not None else None

    @property
    def has_draft(self) -> bool:
        return self.cfg is not None and not self.cfg.draft.is_none

    def default_mode(self) -> str:
        return self.mode or default_mode(self.has_draft)

    def tokenize(self, text: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a raw prompt, or of chat messages formatted with the model's chat template."""
        tok = self._require_ready().tokenizer
        return tok.chat_messages(messages) if messages is not None else tok.encode(text or "")

    def queue_depth(self) -> int:
        """Requests waiting (not counting the ones being generated)."""
        with self._cond:
            return len(self._queue)

    def n_running(self) -> int:
        with self._cond:
            return (self._current is not None) + len(self._running)

    def busy(self) -> bool:
        return self.n_running() > 0

    @property
    def current(self) -> Ticket | None:  # --parallel 1: the request being generated
        return self._current

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None], tag: str = "") -> Ticket:
        """Queue a request. Raises ServiceUnavailable (not ready, queue full) or InvalidRequest."""
        self._require_ready()
        self.check(request)
        with self._cond:
            self._require_ready()
            # Requests in the service (waiting or running), counted the same whether or not the
            # pipeline thread has taken them yet: at most `parallel` running plus max_queue waiting.
            running = (self._current is not None) + len(self._running)
            if len(self._queue) + running >= self.max_queue + self.parallel:
                generating = "one request" if self.parallel == 1 else f"{self.parallel} requests (--parallel)"
                raise ServiceUnavailable(f"the queue is full ({generating} generating, {self.max_queue} waiting: "
                                         f"--queue {self.max_queue}); try again shortly", "queue_full", retry_after=1)
            self._seq += 1
            ticket = Ticket(self._seq, request, on_event, tag)
            self._queue.append(ticket)
            self._cond.notify_all()
        return ticket

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request that cannot run: unknown mode, a mode without a draft, too long for the context."""
        mode = request.mode or self.default_mode()
        if mode not in MODES:
            raise InvalidRequest(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", "mode")
        if needs_draft(mode) and not self.has_draft:
            raise InvalidRequest(f"mode {mode} needs a draft, and this server has none (start it with --draft MODEL, "
                                 "--draft lookup or a pair name); use mode iterative", "mode")
        if not request.prompt:
            raise InvalidRequest("the prompt is empty; send some text", "prompt")
        cfg = self.cfg
        n_prompt = len(request.prompt)
        margin = spec_margin(mode, self.decode_options(request))
        n_ctx = cfg.slot_ctx  # each request's share of --ctx (all of it with --parallel 1)
        context = f"the context of {n_ctx} cells (--ctx)" if cfg.parallel == 1 else \
            f"a slot's context of {n_ctx} cells (--ctx {cfg.n_ctx} / --parallel {cfg.parallel})"
        room = n_ctx - n_prompt - margin  # tokens the context still holds after the prompt
        if room < 1:
            raise RequestTooLong(f"the prompt has {n_prompt} tokens, too many for {context} with room to generate "
                                 f"({margin} cells are kept for speculative runs in flight); shorten it to at most "
                                 f"{n_ctx - margin - 1} tokens", "prompt")
        n = cfg.decode.n_predict if request.n_predict is None else request.n_predict
        if n > room:
            raise RequestTooLong(f"{n} tokens after a prompt of {n_prompt} need {n_prompt + n + margin} KV cells "
                                 f"(with {margin} for speculative runs in flight), more than {context}; ask for at "
                                 f"most {room}", "n_predict")

    def decode_options(self, request: GenerationRequest) -> DecodeOptions:
        """The request's speculation settings: the job's, with what its `speculative` dict changes.
        InvalidRequest names the field (speculative.n_min) when they do not fit together."""
        from dataclasses import replace

        spec = request.speculative or {}
        d = self.cfg.decode if self.default_decode is None else self.default_decode()
        if not spec:
            return d
        n_max, n_min = spec.get("n_max", d.n_draft), spec.get("n_min", d.n_min)
        if n_min > n_max:
            raise InvalidRequest(f"speculative.n_min ({n_min}) is larger than speculative.n_max ({n_max}); "
                                 "ask for at most as many as n_max", "speculative.n_min")
        return replace(d, n_draft=n_max, n_min=n_min, p_min=spec.get("p_min", d.p_min))

    def stop(self, reason: str = "the server is shutting down") -> None:
        """End the service (from any thread but a signal handler's): every request waiting or running
        ends with an "error" event now, and requests() ends once the running one has stopped."""
        self._end("stopping", reason)

    def fail(self, message: str) -> None:
        """The job failed (a rank died): every request ends with an "error" event, none is taken any more."""
        self._end("failed", message)

    # -- what the pipeline thread calls ------------------------------------------------------------
    def attach(self, cfg: JobConfig, loaded: Loaded) -> None:
        self.cfg, self.loaded = cfg, loaded

    def callbacks(self) -> Callbacks:
        return Callbacks(on_start=self._ready, on_token=self._token, on_text=self._text, on_result=self._result)

    def requests(self) -> Iterator[tuple[Request, list[int]]]:
        """(Request, prompt) pairs in FIFO order, blocking for the next one; ends on stop() or fail()."""
        while (ticket := self._take()) is not None:
            yield self.job_request(ticket), list(ticket.request.prompt)
            with self._cond:
                self._current = None

    def job_request(self, ticket: Ticket) -> Request:
        """The job's Request for a ticket."""
        r = ticket.request
        return Request(mode=r.mode or self.default_mode(), label=str(ticket.seq), stop=list(r.stop),
                       sampling=r.sampling, n_predict=r.n_predict, resume=list(r.resume),
                       decode=self.decode_options(r) if r.speculative or self.default_decode else None,
                       cancelled=lambda t=ticket: t.cancelled or self.status != "ok")

    # -- what the parallel runner calls (runtime/parallel.py) ---------------------------------------
    def take_parallel(self, timeout: float) -> Ticket | None:
        """The next request for a free slot, waiting at most `timeout` s; None if none came (or the
        service ended)."""
        return self._take(parallel=True, timeout=timeout)

    def ticket_callbacks(self, ticket: Ticket) -> Callbacks:
        """One request's callbacks (called from its slot's thread)."""
        return Callbacks(on_token=ticket.committed, on_text=ticket.text,
                         on_result=lambda result: self._finish(ticket, result))

    def release(self, ticket: Ticket) -> None:
        """A parallel request has ended (its result or its error was emitted)."""
        with self._cond:
            self._running.pop(ticket.seq, None)

    # -- internals ------------------------------------------------------------------------------
    # -- what a front that outlives its job calls (server/front.py) -----------------------------------
    def pause(self, message: str) -> None:
        """The pipeline is gone and another is being started: requests are still taken and wait
        (status "restarting"); none is handed out until resume_serving()."""
        with self._cond:
            if self.status in ("ok", "loading"):
                self.status, self.message = "restarting", message

    def mark_ready(self) -> None:
        """The models are loaded elsewhere (a front's job): as the pipeline thread's on_start says."""
        self._ready(None)

    def resume_serving(self) -> None:
        with self._cond:
            if self.status == "restarting":
                self.status, self.message = "ok", "ready"
                self._cond.notify_all()

    def requeue(self, tickets: list[Ticket]) -> None:
        """Put requests that were running back at the head of the queue, in their order, to run again."""
        with self._cond:
            for t in sorted(tickets, key=lambda t: t.seq, reverse=True):
                self._running.pop(t.seq, None)
                if not t.finished:
                    self._queue.appendleft(t)
            self._cond.notify_all()

    def _require_ready(self) -> Service:
        if self.status == "restarting":
            return self  # queued until the new pipeline is up
        if self.status == "loading":
            raise ServiceUnavailable("the model is still loading; try again shortly", "loading", retry_after=5)
        if self.status != "ok":
            raise ServiceUnavailable(self.message, self.status)
        return self

    def _take(self, parallel: bool = False, timeout: float | None = None) -> Ticket | None:
        """The next live ticket, made current (or one of the running ones, parallel). Waits for one
        forever, or at most `timeout` s; reads the heartbeats while nothing runs."""
        deadline = None if timeout is None else now() + timeout
        with self._cond:
            while True:
                if self.status != "ok":
                    return None
                while self._queue:
                    ticket = self._queue.popleft()
                    if ticket.cancelled:  # its client went away while it waited
                        ticket.emit(Event("error", text="cancelled", reason="cancelled"))
                        continue
                    ticket.t_start = now()
                    ticket.run_index = self._runs
                    self._runs += 1
                    if parallel:
                        self._running[ticket.seq] = ticket
                    else:
                        self._current = ticket
                    return ticket
                left = 0.5 if deadline is None else min(0.5, deadline - now())
                if left <= 0:
                    return None
                self._cond.wait(timeout=left)
                if self.idle_check is not None and not self._running:
                    self.idle_check()

    def _end(self, status: str, message: str) -> None:
        with self._cond:
            if self.status in ("failed", "stopping"):
                return
            self.status, self.message = status, message
            tickets = list(self._queue) + ([self._current] if self._current is not None else []) + \
                list(self._running.values())
            self._queue.clear()
            self._cond.notify_all()
        for t in tickets:
            t.cancel()
            t.emit(Event("error", text=message, reason=status))

    def _ready(self, _tokenizer) -> None:
        if self.on_ready is not None:
            self.on_ready(self)  # first: whoever sees "ok" sees what on_ready printed
        with self._cond:
            if self.status == "loading":
                self.status, self.message = "ok", "ready"

    def _token(self, token: int) -> None:
        if self._current is not None:
            self._current.committed(token)

    def _text(self, text: str) -> None:
        if self._current is not None:
            self._current.text(text)

    def _result(self, result: GenerationResult) -> None:
        if self._current is not None:
            self._finish(self._current, result)
        with self._cond:
            self._current = None  # the pipeline is idle until the next request (the caches hold at most the
            # committed tokens, kept for prefix reuse)

    def _finish(self, t: Ticket, result: GenerationResult) -> None:
        for r in result.ranks:
            r.trace = None  # a long-running server keeps no trace events
        result.queue_s, result.request_seq, result.run_index = t.queue_s, t.seq, t.run_index
        t.emit(Event("done", result=result))
        for fn in self._observers:
            fn(t, result)

"""What a client hands the generation service and gets back: the request, its ticket and the
events it receives, and the refusals (runtime/service.py runs them; a server's front holds them
while its job is restarted: server/front.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decode.metrics import now
from ..decode.result import GenerationResult
from ..decode.sampling import SamplingParams
from ..errors import PipeinferError, UsageError


class ServiceUnavailable(PipeinferError):
    """The service cannot take a request now: still loading, queue full, failed or stopping.

    retry_after: seconds after which trying again makes sense (None: it will not)."""

    def __init__(self, msg: str, reason: str, retry_after: int | None = None):
        super().__init__(msg)
        self.reason, self.retry_after = reason, retry_after


class InvalidRequest(UsageError):
    """A request the service refuses. field: what is wrong ("mode", "prompt" or "n_predict");
    code: a short machine-readable reason."""

    def __init__(self, msg: str, field: str, code: str = "invalid_value"):
        super().__init__(msg)
        self.field, self.code = field, code


class RequestTooLong(InvalidRequest):
    """Prompt + tokens to generate (+ the cells of speculative runs in flight) exceed the context."""

    def __init__(self, msg: str, field: str):
        super().__init__(msg, field, "context_length_exceeded")


@dataclass
class GenerationRequest:
    """What a client asks for. Fields left None take the job's settings (`pipeinfer serve` options)."""

    prompt: list[int]  # token ids (see Service.tokenize)
    mode: str | None = None  # iterative / speculative / pipeinfer
    n_predict: int | None = None  # tokens at most; -1: until end of text or a full context
    sampling: SamplingParams | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text)
    # llama-server's speculative.n_max / n_min / p_min for this request ({"n_max": 8, ...}); the
    # job's --n-draft / --draft-min / --p-min for the keys it leaves out.
    speculative: dict | None = None
    # Tokens this request committed on a job that was lost (server/front.py resumes it): replayed after
    # the prompt, not shown again; n_predict still counts them.
    resume: list[int] = field(default_factory=list)


@dataclass
class Event:
    """What a ticket's callback receives: "text" (text to show), then one "done" (result) or "error"."""

    kind: str
    text: str = ""  # "text": the text; "error": the message
    result: GenerationResult | None = None  # "done": the request's result
    reason: str = ""  # "error": "failed" (a rank failed), "stopping" (shutdown), "cancelled"
    # "text": the tokens committed since the previous text event, whose text this is (with what a
    # stop string held back): what a front that resumes the request after a lost job must replay.
    tokens: list[int] = field(default_factory=list)


class Ticket:
    """One submitted request, from submit() until its "done" or "error" event."""

    def __init__(self, seq: int, request: GenerationRequest, on_event: Callable[[Event], None], tag: str = ""):
        self.seq = seq  # 1, 2, … in submission order
        self.tag = tag  # the submitter's label (the server: its endpoint), handed to observers
        self.request = request
        self.on_event = on_event
        self.t_submit = now()
        self.t_start: float | None = None  # taken off the queue
        self.t_first_token: float | None = None
        self.run_index: int | None = None  # 0, 1, … in the order the pipeline took the requests
        self.n_tokens = 0
        self.unshown: list[int] = []  # committed, not yet in a text event
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self.finished = False

    def committed(self, token: int) -> None:
        """A token committed (pipeline thread)."""
        self.n_tokens += 1
        self.unshown.append(token)
        if self.t_first_token is None:
            self.t_first_token = now()

    def text(self, text: str) -> None:
        """Text shown for the tokens committed since the previous text event (pipeline thread)."""
        tokens, self.unshown = self.unshown, []
        self.emit(Event("text", text=text, tokens=tokens))

    def cancel(self) -> None:
        """Stop this request (from any thread): dropped if queued, ended at its next commit if running."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_s(self) -> float | None:
        return None if self.t_start is None else self.t_start - self.t_submit

    def emit(self, event: Event) -> None:
        """Deliver an event; nothing after the final one ("done"/"error")."""
        with self._lock:
            if self.finished:
                return
            self.finished = event.kind in ("done", "error")
        self.on_event(event)

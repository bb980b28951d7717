"""One request a job runs (`Request`): plain data, low in the runtime layer (the job's configuration,
`JobConfig`, is the planner's: planner/job_config.py), so that every module a job goes through names
the shape of what it is given without importing the job that runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..decode.sampling import SamplingParams
from ..decode.session import DecodeOptions


@dataclass
class Request:
    """One generation: a raw prompt or chat messages, and the decoding mode."""

    mode: str
    prompt: str | None = None  # raw text
    chat: list[dict] | None = None  # messages, formatted with the model's chat template
    label: str = ""  # prompt id, for reports
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends where one appears
    # Per-request overrides of the job's settings (a server's requests); None: the job's own.
    sampling: SamplingParams | None = None
    n_predict: int | None = None  # tokens to generate; -1: until end of text or a full context
    cancelled: Callable[[], bool] | None = None  # polled at each commit: True ends it ("cancelled")
    lookup_only: bool = False  # draft this request by prompt lookup, not with the job's draft model
    decode: DecodeOptions | None = None  # this request's speculation settings (a server request's); None: the job's
    # Record this request's trace once it has run (`--save-trace`, planner/record.request_trace): its
    # prompt and committed tokens and, with a draft model of the target's vocabulary, the draft's
    # chains this deep (> 0 with a draft model: the job loads it even for iterative; 0: tokens only).
    # None: no trace.
    trace_depth: int | None = None
    # Tokens this request committed on a job that was lost (a server resuming it on a new job): they
    # are replayed after the prompt and not shown again, and generation continues after them.
    resume: list[int] = field(default_factory=list)

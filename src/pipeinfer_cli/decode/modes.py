"""The decoding modes, in one place: per mode, whether it needs a draft, the KV cells it may fill
beyond the committed tokens, and its decode entry point. The head, the service and the CLI ask
here instead of comparing mode names; `decode()` is the one way in.

Importing this starts no MPI: the modes talk to a `PipelineLike` (pipeline_protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError
from .session import DecodeOptions

if TYPE_CHECKING:
    from .drafters import Drafter, AsyncDrafter
    from .pipeline_protocol import PipelineLike


@dataclass(frozen=True)
class Mode:
    name: str
    needs_draft: bool  # a draft (model or lookup) proposes tokens
    summary: str  # one line for help texts

    def kv_margin(self, opts: DecodeOptions) -> int:
        """KV cells beyond prompt + generated tokens that the mode may fill: speculative runs in
        flight write past the last committed token (rejected cells are removed again)."""
        if not self.needs_draft:
            return 1
        return opts.n_draft * (opts.max_inflight if self.name == "pipeinfer" else 1) + 2


ITERATIVE = Mode("iterative", False, "one token per pass through the pipeline")
SPECULATIVE = Mode("speculative", True, "draft k tokens, verify them in one batch (synchronous)")
PIPEINFER = Mode("pipeinfer", True, "asynchronous pipelined speculation with early cancellation")
MODES: dict[str, Mode] = {m.name: m for m in (ITERATIVE, SPECULATIVE, PIPEINFER)}
MODE_NAMES = tuple(MODES)


class UnknownModeError(UsageError):
    """A mode name that is not one of MODE_NAMES. field: where the front end took it from."""

    def __init__(self, mode: str, field: str = "--mode"):
        super().__init__(f"unknown {field} {mode!r}; choose one of {', '.join(MODE_NAMES)}")
        self.mode, self.field = mode, field


class DraftNeededError(UsageError):
    """A mode that needs a draft, in a job that has none (the CLI's wording; the server has its own)."""

    def __init__(self, mode: str):
        super().__init__(f"--mode {mode} needs a draft: pass --draft MODEL, --draft lookup, or a pair name such as "
                         "qwen-coder")
        self.mode = mode


def get_mode(name: str, field: str = "--mode") -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise UnknownModeError(name, field) from None


def needs_draft(name: str) -> bool:
    return get_mode(name).needs_draft


def default_mode(has_draft: bool) -> str:
    """Without a mode asked for: pipeinfer (the product's mode) when there is a draft."""
    return PIPEINFER.name if has_draft else ITERATIVE.name


def check_mode(name: str | None, has_draft: bool, field: str = "--mode") -> str:
    """The mode to run: the one asked for (checked), or the default; DraftNeededError when it
    needs a draft the job does not have."""
    mode = get_mode(default_mode(has_draft) if name is None else name, field)
    if mode.needs_draft and not has_draft:
        raise DraftNeededError(mode.name)
    return mode.name


def decode(name: str, pipe: PipelineLike, s, opts: DecodeOptions, drafter: Drafter | AsyncDrafter | None = None, *, prompt_pass=None, memory=None) -> None:
    """Generate a prefilled session's tokens in mode `name` (pipe: a PipelineLike)."""
    from .min_draft import with_min_length
    from .sync import decode_iterative, decode_speculative

    drafter = with_min_length(drafter, opts.n_min)
    if name == ITERATIVE.name:
        decode_iterative(pipe, s)
    elif name == SPECULATIVE.name:
        decode_speculative(pipe, s, opts, drafter)
    else:
        from .pipeinfer import decode_pipeinfer

        decode_pipeinfer(pipe, s, opts, drafter, prompt_pass=prompt_pass, memory=memory)

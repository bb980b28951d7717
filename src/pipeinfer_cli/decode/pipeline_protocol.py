"""The one protocol every decoding policy talks to: the real pipeline (`pipeline.Pipeline`, MPI)
or a simulated one (the tests' fake, a planner's virtual-time pipeline). Importing it starts no
MPI, so the policies that use it do not either."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .sampling import SamplingParams


@dataclass
class RunResult:
    """What comes back to the head for one run, in launch order."""

    run_id: int
    tokens: np.ndarray | None  # int64 (n_out,): the target's sampled token after each requested row;
    #                            None when the run was cancelled on some stage


class PipelineLike(Protocol):
    """What the decoding modes use of a pipeline."""

    engine: object  # the head's layer engine: .n_seq_max, .n_ctx
    n_stages: int
    trace: object  # .slice(name, t0, t1, **args), .instant(name, t, **args)
    ready: deque  # results received, oldest first (RunResult: run_id, sampled tokens or None)

    def set_sampling(self, params: SamplingParams) -> None:
        """How the rows of the runs launched from now on are sampled (every request starts here)."""

    def launch(self, tokens: list[int], pos: list[int], seq_ids: list[list[int]], output: list[bool],
               speculative: bool = False, invariant: bool = True) -> int:
        """Start a run (a batch through every stage); its run id."""

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None: ...

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...

    def cancel(self, run_ids: list[int]) -> None:
        """Drop these runs on every stage (before they start, or between two layers)."""

    def poll(self) -> bool:
        """Take what has arrived; True if a result is ready."""

    def next_result(self):
        """The oldest outstanding result, waiting for it (the pipeline's own way of waiting)."""

    def wait_until(self, cond: Callable[[], bool]) -> None:
        """Return once cond() is true; cond polls what it waits for."""

    # Optional: `may_speculate() -> bool`, whether a speculative run may go now. A slot of a
    # pipeline shared by parallel requests has it (runtime/slot_pipeline.py, the load policy of
    # decode/parallel_policy.py); a pipeline without it always lets speculation through.


def may_speculate(pipe: PipelineLike) -> bool:
    """The pipeline's word on a speculative run now (True when it has no load policy)."""
    ask = getattr(pipe, "may_speculate", None)
    return ask is None or ask()

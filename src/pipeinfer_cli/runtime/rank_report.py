"""What every non-head rank shares with the head about a request: its per-request report, the
abort signal, and the debug fault injection (stages, draft rank and head alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..transport.mpi_link import Link, WaitPolicy
from ..decode.cpu_account import PROCESS, CpuAccount
from ..decode.metrics import process_stats
from ..native import ggml_cpu
from ..process_memory import peak_rss_mib
from ..decode.result import RankReport

if TYPE_CHECKING:
    from .weight_stream import LoadedWeights


@dataclass(frozen=True)
class KvUsage:
    """A rank's answer to KV_USAGE: the KV cells it holds (a draft rank: tokens in its model's cache)."""

    rank: int
    cells: int


class JobAborted(Exception):
    """The head told this rank to stop because the job failed elsewhere."""


def fault_injection(link: Link | None) -> int | None:
    """Where this rank raises on purpose, as its link's fault injector plans it
    (PIPEINFER_DEBUG_FAULT=RANK:raise:N, transport/faults.py): on its N-th run (a stage), draft proposal
    (the draft rank) or committed token (the head, rank 0), to test fault handling. None: never."""
    faults = link.faults if link is not None else None
    return faults.raise_at if faults is not None else None


class RankReporter:
    """One rank's counters for the current request, sent to (or kept by) the head at each REPORT
    as a `RankReport`.

    Every count restarts at each report, so a report is exactly one request's share. cpu_s counts
    CPU seconds since the previous report, so an idle rank that spins would show it; cpu_split says
    where they went (the process's `CpuAccount`, charged by the pipeline, the stage and the draft
    model; cpu: another account, for tests)."""

    def __init__(self, rank: int, role: str, layers, threads: int, trace, engine=None, link: Link | None = None,
                 weights: LoadedWeights | None = None, cpu: CpuAccount = PROCESS):
        self.rank, self.role, self.layers, self.threads = rank, role, layers, threads
        # where the rank's weights came from, once per job (runtime/weight_stream.py LoadedWeights)
        self.weights = weights.as_dict() if weights is not None else None
        self.trace, self.engine, self.link, self.cpu = trace, engine, link, cpu
        self.busy_s = 0.0  # seconds computing (stage evals, draft proposals)
        self.runs = 0  # runs computed or draft requests answered
        self.kv_at_start: int | None = None  # KV cells in use when this request began (after the last clear)
        # ggml's CPU variant in this process: ranks on different CPUs may run different ones
        # (`make install GGML_CPU=all`), whose arithmetic differs in its last bits.
        self.ggml_cpu = ggml_cpu()["variant"]
        self._reset()

    def _reset(self) -> None:
        self.busy_s, self.runs, self.kv_at_start = 0.0, 0, None
        self.cpu.take()
        self._engine0 = dict(self.engine.stats()) if self.engine is not None else None
        if self.link is not None:
            self.link.traffic.take()

    def take(self, rows_requested: int | None = None, skipped_before_start: int | None = None) -> RankReport:
        """The report since the previous one (trace events included); counting starts again."""
        events = list(self.trace.events)
        self.trace.events.clear()
        split = self.cpu.take()
        out = RankReport(self.rank, self.role, self.layers, self.threads, round(peak_rss_mib(), 1),
                         round(self.busy_s, 4), round(split.total_s, 3), self.runs,
                         self._wait_style(), process_stats(), weights=self.weights,
                         rows_requested=rows_requested, skipped_before_start=skipped_before_start, trace=events,
                         cpu_split=split, ggml_cpu=self.ggml_cpu)
        if self.engine is not None:
            stats = dict(self.engine.stats())
            out.engine = {k: v - self._engine0.get(k, 0) for k, v in stats.items()}
            out.kv_used_cells = self.engine.kv_used_cells()
            out.kv_used_cells_at_start = self.kv_at_start
            out.kv_min_resume = self.engine.kv_min_resume(0)  # the canonical sequence (window cache)
        if self.link is not None:
            out.wire = self.link.traffic.take()
        self._reset()
        return out

    def _wait_style(self) -> str:
        """How this rank waits for messages (its link's wait policy; the environment's without a link)."""
        return (self.link.wait_policy if self.link is not None else WaitPolicy.from_env()).style()

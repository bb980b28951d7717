"""One request's result: what the head hands its callers, and `to_json()`, the object that
`generate --json` prints (docs/json-output.md defines every field; the bench's records and the
server's `timings` are built from the same values).

The JSON is a public interface: `to_json()` keeps its keys, their order and their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cpu_account import CpuSplit
from .metrics import Acceptance, DraftWork, ProcessStats, RunCounters

# Set by the service (`pipeinfer serve`) only; in the JSON once it set them.
SERVICE_FIELDS = ("queue_s", "request_seq", "run_index", "slot")


@dataclass
class RankReport:
    """One rank's share of a request (`runtime/rank_report.py` counts it; docs/json-output.md, "ranks").

    Optional parts are left out of the JSON when None: `weights` (the first request's), the engine's
    counters and KV cells (a rank with an engine), `wire` (a rank with a link), the head's
    `rows_requested` and a stage's `skipped_before_start`, `ggml_cpu` (the CPU variant) and `cpu_split`
    (a rank that counted it)."""

    rank: int
    role: str  # "head", "stage" or "draft"
    layers: list[int] | None  # [begin, end) of the target's layers; None on a draft rank
    threads: int
    peak_rss_mib: float
    busy_s: float  # seconds computing (stage evals, draft proposals)
    cpu_s: float  # CPU seconds since the previous report
    runs: int  # runs computed or draft requests answered
    wait: str  # how the rank waits for messages (its wait policy)
    process: ProcessStats
    weights: dict | None = None
    engine: dict | None = None  # the engine's counters for this request
    kv_used_cells: int | None = None
    kv_used_cells_at_start: int | None = None
    kv_min_resume: int | None = None
    wire: dict | None = None  # bytes and messages sent and received, seconds waiting
    rows_requested: int | None = None  # head: rows asked of the pipeline
    skipped_before_start: int | None = None  # stage: runs cancelled before they started
    trace: list | None = field(default_factory=list)  # trace events (None: dropped); never in generate's JSON
    clock_offset_s: float | None = None  # this rank's clock against the head's (set by the head)
    cpu_split: CpuSplit | None = None  # cpu_s by kind of work: target layers, draft model, the rest (decode/cpu_account.py)
    ggml_cpu: str | None = None  # ggml's CPU variant in this rank's process ("zen4", "haswell"; "builtin": one build)

    def as_dict(self, trace: bool = False) -> dict:
        """The JSON object, keys in their historical order."""
        d = {"rank": self.rank, "role": self.role, "layers": self.layers, "threads": self.threads,
             "peak_rss_mib": self.peak_rss_mib, "busy_s": self.busy_s, "cpu_s": self.cpu_s, "runs": self.runs,
             "wait": self.wait, "process": self.process.as_dict()}
        if self.weights is not None:
            d["weights"] = self.weights
        if self.engine is not None:
            d.update(engine=self.engine, kv_used_cells=self.kv_used_cells,
                     kv_used_cells_at_start=self.kv_used_cells_at_start, kv_min_resume=self.kv_min_resume)
        for key in ("wire", "rows_requested", "skipped_before_start"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if trace and self.trace is not None:
            d["trace"] = self.trace
        if self.clock_offset_s is not None:
            d["clock_offset_s"] = self.clock_offset_s
        if self.ggml_cpu is not None:
            d["ggml_cpu"] = self.ggml_cpu
        if self.cpu_split is not None:
            d["cpu_split"] = self.cpu_split.as_dict()
        return d


@dataclass
class GenerationResult:
    prompt_id: str  # the request's label: the prompt's id in a benchmark, the request number in a server
    mode: str  # decoding mode: iterative, speculative or pipeinfer
    model: str  # the target model's label
    draft: str | None  # the draft's label (a model, or "lookup"); None without one
    layer_split: str  # layers per stage of the target pipeline (the topology's description)
    n_ctx: int  # KV cells of every cache (--ctx)
    text: str  # the generated text as shown (UTF-8 completed, cut before a stop string)
    tokens: list[int]  # the generated token ids
    finish_reason: str | None  # "stop" (end-of-generation token or a stop string), "length" (-n reached), "cancelled"
    n_prompt: int  # prompt tokens
    n_gen: int  # generated tokens
    ttft_s: float | None  # start of prompt processing (models loaded) -> first token known at the head
    tok_per_s: float | None  # n_gen / (t_last_token - t_start)
    decode_tok_per_s: float | None  # (n_gen - 1) / (t_last_token - t_first_token)
    itl_ms: dict | None  # {"mean", "p50", "p90"} of the gaps between token arrivals (a burst is one arrival)
    acceptance: Acceptance  # drafted, accepted, rate, mean_accepted_len (the last two are properties)
    runs: RunCounters  # launched, speculative, cancelled, ... (summed over the stages where the engine counts)
    wire: dict  # per link bytes and messages, head bytes per token and per row, wait_s per rank, handoff_ms
    t_start: float  # head clock (perf_counter) at the start of prompt processing
    t_end: float  # head clock once every rank's report was in
    ranks: list[RankReport]  # per rank: role, layers, threads, RSS, busy and CPU seconds, KV cells, engine
    #                          counters, wire traffic; in process also its "trace" events, never in the JSON
    reused_tokens: int = 0  # prompt tokens whose KV cells were kept from the previous request (prefix reuse)
    common_prefix_tokens: int = 0  # prompt tokens in common with the previous request, reused or not
    draft_vocab: str | None = None  # "direct" (the draft's tokens are the target's) or "translated" (through text); None without a draft
    drafting: DraftWork = field(default_factory=DraftWork)  # tokens the drafter proposed and launched (per committed token in the JSON)
    debug_diverged: bool = False  # PIPEINFER_DEBUG_DIVERGE changed the last token (tests); in the JSON only if set
    queue_s: float | None = None  # serve: seconds the request waited in the queue
    request_seq: int | None = None  # serve: the request's number, in submission order
    run_index: int | None = None  # serve: the order in which the pipeline took the requests
    slot: int | None = None  # serve --parallel: the KV slot it ran in
    prompt_trace: object = None  # planner.replay.PromptTrace when the request asked for one (--save-trace); never in the JSON

    def to_json(self, trace: bool = False) -> dict:
        """The JSON object of `generate --json`: keys in this order, values as JSON types.

        trace: keep each rank's trace events (the bench's in-memory records, for its Chrome trace)."""
        d = {
            "prompt_id": self.prompt_id, "mode": self.mode, "model": self.model, "draft": self.draft,
            "layer_split": self.layer_split, "n_ctx": self.n_ctx, "text": self.text, "tokens": self.tokens,
            "finish_reason": self.finish_reason, "n_prompt": self.n_prompt, "n_gen": self.n_gen,
            "ttft_s": self.ttft_s, "tok_per_s": self.tok_per_s, "decode_tok_per_s": self.decode_tok_per_s,
            "itl_ms": self.itl_ms, "acceptance": self.acceptance.to_dict(), "runs": vars(self.runs).copy(),
            "wire": self.wire, "t_start": self.t_start, "t_end": self.t_end,
            "ranks": [r.as_dict(trace) for r in self.ranks],
            "reused_tokens": self.reused_tokens, "common_prefix_tokens": self.common_prefix_tokens,
            "draft_vocab": self.draft_vocab,  # after the keys that came before it: their order is kept
            "drafting": self.drafting.to_dict(self.n_gen),
        }
        if self.debug_diverged:
            d["debug_diverged"] = True
        if self.request_seq is not None:
            d.update({k: getattr(self, k) for k in SERVICE_FIELDS})
        return d

    def kv_used_cells(self) -> dict[str, int]:
        """KV cells in use per rank (by rank number as a string) at the end of the request."""
        return {str(r.rank): r.kv_used_cells for r in self.ranks if r.kv_used_cells is not None}

"""Run a benchmark schedule as one job (models loaded once) and turn results into records.

`run_bench` runs on every MPI rank, like `run_job`; it returns the records on the head only.
A record is the JSON of the job's result (`GenerationResult.to_json`, with every rank's trace events
for the Chrome trace) plus where it sits in the schedule: `index`, `repeat`, `warmup`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..wording import plural
from ..decode.result import GenerationResult
from ..runtime.job import JobConfig, Request, run_job
from .schedule import BenchItem


def to_request(item: BenchItem, trace_depth: int | None = None) -> Request:
    p = item.prompt
    return Request(mode=item.mode, prompt=p.prompt, chat=[dict(m) for m in p.messages] if p.messages else None,
                   label=p.id, trace_depth=trace_depth)


def requests_of(items: list[BenchItem], trace_depth: int | None = None) -> list[Request]:
    """The schedule's requests; with trace_depth, the first request of each prompt records its trace
    (every mode gives the same tokens: once per prompt is enough)."""
    seen: set[str] = set()
    out = []
    for item in items:
        first = item.prompt.id not in seen
        seen.add(item.prompt.id)
        out.append(to_request(item, trace_depth if first else None))
    return out


def run_bench(cfg: JobConfig, items: list[BenchItem], on_record: Callable[[dict], None] | None = None,
              results_out: list[GenerationResult] | None = None, trace_depth: int | None = None) -> list[dict] | None:
    """Run every item in order; on_record(record) on the head as each one finishes. results_out:
    gets the results that recorded a trace (trace_depth: see `requests_of`)."""
    records: list[dict] = []

    def on_result(result: GenerationResult) -> None:
        if results_out is not None and result.prompt_trace is not None:
            results_out.append(result)
        item = items[len(records)]
        rec = {"index": item.index, "prompt_id": item.prompt.id, "mode": item.mode, "repeat": item.repeat,
               "warmup": item.warmup,
               **{k: v for k, v in result.to_json(trace=True).items() if k not in ("prompt_id", "mode")}}
        records.append(rec)
        if on_record:
            on_record(rec)

    results = run_job(cfg, requests_of(items, trace_depth), on_result=on_result)
    return None if results is None else records


def check_tokens(records: list[dict], modes: list[str]) -> list[dict]:
    """Compare every record's tokens with its prompt's reference; return one entry per mismatch.

    The reference of a prompt is its first `iterative` record (plain decoding), else the first
    record of the first mode. Warmup records are checked too: any difference is a bug. Each record
    gets `tokens_match` (bool) and `reference_mode`.
    """
    ref_mode = "iterative" if "iterative" in modes else modes[0]
    refs: dict[str, dict] = {}
    for rec in records:
        if rec["mode"] == ref_mode:
            refs.setdefault(rec["prompt_id"], rec)
    mismatches = []
    for rec in records:
        ref = refs.get(rec["prompt_id"]) or rec
        a, b = rec["tokens"], ref["tokens"]
        rec["reference_mode"] = ref["mode"]
        rec["tokens_match"] = a == b
        if a == b:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        mismatches.append({
            "prompt_id": rec["prompt_id"], "mode": rec["mode"], "repeat": rec["repeat"], "warmup": rec["warmup"],
            "index": rec["index"], "reference_mode": ref["mode"], "reference_index": ref["index"],
            "first_diff": first, "n_gen": len(a), "reference_n_gen": len(b),
            "got": a[first] if first < len(a) else None, "expected": b[first] if first < len(b) else None,
        })
    return mismatches


def describe_mismatch(m: dict) -> str:
    what = (f"token {m['first_diff']} is {m['got']} instead of {m['expected']}" if m["got"] is not None and m["expected"] is not None
            else f"{plural(m['n_gen'], 'token')} instead of {m['reference_n_gen']}")
    run = "warmup" if m["warmup"] else "repeat"
    return (f"prompt {m['prompt_id']!r}: {m['mode']} ({run} {m['repeat']}) differs from {m['reference_mode']}: {what}")

"""`pipeinfer bench --concurrency`: a closed-loop load on one `pipeinfer serve` job.

For every mode and every concurrency level C, the prompt set is sent as streaming requests with C
in flight at once: C workers share one list of requests, and a worker starts the next request as
soon as its previous one ended (asyncio and the official `openai` async client; no threads).

Per request: TTFT (request sent → first streamed non-empty text), the gaps between streamed
chunks (inter-token latency as a client sees it: tokens committed together arrive in one chunk and
count as one arrival, as `itl_ms` of `generate --json`), completion tokens (the server's usage,
exactly), the text and, when the server sends them, its token ids and timings. Per (mode, level):
aggregate tok/s = completion tokens / wall time of the level, requests/s, TTFT and ITL p50/p99, and
the mean of the per-request decode tok/s. Every text is compared with the same prompt's text at
level 1 in the same mode: concurrency must not change what is generated.

This module holds no process or CLI logic (bench/server_job.py starts the server).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..wording import plural
from .prompts import BenchPrompt

SCHEMA = "pipeinfer-bench-concurrency/1"
MAX_LEVEL = 10000  # as serve's --queue
REQUEST_TIMEOUT_S = 3600.0


# -- input ------------------------------------------------------------------------------------------
def parse_levels(text: str) -> list[int]:
    """--concurrency "1,2,4,8" → [1, 2, 4, 8]: integers >= 1, ascending, level 1 always first."""
    items = [s.strip() for s in text.split(",")]
    if not any(items):
        raise UsageError("--concurrency is empty; give levels such as 1,2,4,8")
    levels: list[int] = []
    for s in items:
        if not s:
            raise UsageError(f"--concurrency {text!r} has an empty item; give comma-separated integers such as 1,2,4")
        try:
            level = int(s)
        except ValueError:
            raise UsageError(f"--concurrency level {s!r} is not an integer; give comma-separated integers "
                             "such as 1,2,4") from None
        if level < 1:
            raise UsageError(f"--concurrency level {level} is not allowed: requests in flight at once must be >= 1")
        if level > MAX_LEVEL:
            raise UsageError(f"--concurrency level {level} is above {MAX_LEVEL}, the most a server queues")
        if level in levels:
            raise UsageError(f"--concurrency lists {level} more than once")
        levels.append(level)
    return sorted(set(levels) | {1})


# -- statistics -------------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0-100), linear between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0..100")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def decode_tok_per_s(n_tokens: int | None, t_first: float | None, t_last: float | None) -> float | None:
    """(n − 1) / (last chunk − first chunk), as decode_tok_per_s of `generate --json`; None when
    every token came in one chunk."""
    if not n_tokens or n_tokens < 2 or t_first is None or t_last is None or t_last <= t_first:
        return None
    return (n_tokens - 1) / (t_last - t_first)


def aggregate(records: list[dict], wall_s: float) -> dict:
    """The figures of one (mode, level) from its measured records (warmups left out by the caller)."""
    ok = [r for r in records if r.get("error") is None]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    ttft = [r["ttft_s"] * 1e3 for r in ok if r.get("ttft_s") is not None]
    itl = [g for r in ok for g in r.get("itl_ms") or []]
    dec = [r["decode_tok_per_s"] for r in ok if r.get("decode_tok_per_s") is not None]
    return {
        "n_requests": len(records), "n_errors": len(records) - len(ok), "completion_tokens": tokens,
        "wall_s": wall_s,
        "tok_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "decode_tok_per_s_mean": statistics.fmean(dec) if dec else None,
    }


# -- the identity check -----------------------------------------------------------------------------
def check_identical(records: list[dict]) -> list[dict]:
    """Compare every record's text (and token ids, when both have them) with its prompt's first
    measured record at level 1 in the same mode. Sets `identical_to_level_1` on every record (None for a
    failed request or one without a reference) and returns one entry per difference."""
    refs: dict[tuple[str, str], dict] = {}
    for r in records:
        if r["concurrency"] == 1 and not r["warmup"] and r.get("error") is None:
            refs.setdefault((r["mode"], r["prompt_id"]), r)
    mismatches = []
    for r in records:
        ref = refs.get((r["mode"], r["prompt_id"]))
        if r.get("error") is not None or ref is None:
            r["identical_to_level_1"] = None
            continue
        same_text = r["text"] == ref["text"]
        same_tokens = r.get("tokens") is None or ref.get("tokens") is None or r["tokens"] == ref["tokens"]
        r["identical_to_level_1"] = same_text and same_tokens
        if r["identical_to_level_1"]:
            continue
        a, b = r["text"], ref["text"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        mismatches.append({
            "mode": r["mode"], "concurrency": r["concurrency"], "prompt_id": r["prompt_id"], "repeat": r["repeat"],
            "warmup": r["warmup"], "first_diff_char": first if not same_text else None,
            "got": a[first:first + 40] if not same_text else None,
            "expected": b[first:first + 40] if not same_text else None,
            "completion_tokens": r["completion_tokens"], "reference_completion_tokens": ref["completion_tokens"],
            "tokens_identical": same_tokens,
        })
    return mismatches


def describe_mismatch(m: dict) -> str:
    run = "warmup" if m["warmup"] else f"repeat {m['repeat']}"
    if m["first_diff_char"] is None:
        what = "same text, different token ids"
    else:
        what = f"text differs from character {m['first_diff_char']}: {m['got']!r} instead of {m['expected']!r}"
    return (f"prompt {m['prompt_id']!r}, {m['mode']} at concurrency {m['concurrency']} ({run}) differs from "
            f"concurrency 1: {what}")


def summarize(records: list[dict], modes: list[str], levels: list[int], walls: dict[tuple[str, int], float],
              peaks: dict[tuple[str, int], int]) -> list[dict]:
    """One row per (mode, level), in run order, after check_identical."""
    rows = []
    for mode in modes:
        base = None
        for level in levels:
            rs = [r for r in records if r["mode"] == mode and r["concurrency"] == level and not r["warmup"]]
            row = {"mode": mode, "concurrency": level, **aggregate(rs, walls.get((mode, level), 0.0)),
                   "peak_in_flight": peaks.get((mode, level), 0)}
            if level == 1:
                base = row["tok_per_s"]
            row["tok_per_s_vs_level_1"] = row["tok_per_s"] / base if base and row["tok_per_s"] else None
            checked = [r for r in records if r["mode"] == mode and r["concurrency"] == level]
            row["mismatched_prompts"] = sorted({r["prompt_id"] for r in checked if r["identical_to_level_1"] is False})
            row["identical_to_level_1"] = not row["mismatched_prompts"] and all(
                r["identical_to_level_1"] for r in checked)
            rows.append(row)
    return rows


def document(header: dict, summary: list[dict], mismatches: list[dict], records: list[dict]) -> dict:
    """The --json object (docs/json-output.md, "bench --concurrency")."""
    return {"schema": SCHEMA, "header": header, "summary": summary,
            "identical_to_level_1": not mismatches and all(r["identical_to_level_1"] for r in summary),
            "mismatches": mismatches, "records": records}


# -- the load ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadRequest:
    prompt: BenchPrompt
    mode: str
    repeat: int
    warmup: bool = False


@dataclass(frozen=True)
class Sampling:
    """What every request asks for (bench's -n and sampling options)."""

    n_predict: int  # -1: the server's own -n (which bench set to -1 too)
    temperature: float
    seed: int
    top_k: int
    top_p: float
    min_p: float


def level_requests(prompts: list[BenchPrompt], mode: str, repeat: int) -> list[LoadRequest]:
    """The requests of one (mode, level): every prompt, `repeat` times, a repeat after the other."""
    return [LoadRequest(p, mode, rep) for rep in range(repeat) for p in prompts]


async def one_request(client, req: LoadRequest, sampling: Sampling, level: int, t0: float, index: int = 0) -> dict:
    """Send one streaming request and time it; errors are recorded, not raised (except cancellation)."""
    import openai

    p = req.prompt
    kwargs = {"model": "pipeinfer", "stream": True, "stream_options": {"include_usage": True},
              "temperature": sampling.temperature, "seed": sampling.seed, "top_p": sampling.top_p,
              "extra_body": {"mode": req.mode, "top_k": sampling.top_k, "min_p": sampling.min_p}}
    if sampling.n_predict != -1:
        kwargs["max_tokens"] = sampling.n_predict
    rec = {"mode": req.mode, "concurrency": level, "index": index, "prompt_id": p.id, "repeat": req.repeat, "warmup": req.warmup,
           "kind": p.kind, "start_s": None, "end_s": None, "ttft_s": None, "itl_ms": [], "n_chunks": 0,
           "completion_tokens": None, "tokens_counted_by": None, "decode_tok_per_s": None, "finish_reason": None,
           "text": "", "tokens": None, "server_timings": None, "error": None}
    arrivals: list[float] = []
    pieces: list[str] = []
    usage = extension = None
    start = time.perf_counter()
    rec["start_s"] = start - t0
    try:
        if p.messages is not None:
            stream = await client.chat.completions.create(messages=[dict(m) for m in p.messages], **kwargs)
        else:
            stream = await client.completions.create(prompt=p.prompt, **kwargs)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices:
                    choice = chunk.choices[0]
                    piece = (choice.delta.content if choice.delta is not None else None) if p.messages is not None \
                        else choice.text
                    if piece:
                        arrivals.append(now)
                        pieces.append(piece)
                    if choice.finish_reason:
                        rec["finish_reason"] = choice.finish_reason
                        extra = chunk.model_extra or {}
                        extension = extra.get("pipeinfer")
                        rec["server_timings"] = extra.get("timings")
                if chunk.usage is not None:
                    usage = chunk.usage
    except openai.OpenAIError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end_s"] = time.perf_counter() - t0
    _finish_record(rec, start, arrivals, pieces, usage, extension)
    return rec


def _finish_record(rec: dict, start: float, arrivals: list[float], pieces: list[str], usage, extension: dict | None) -> None:
    """Text, timings and the token count of a request from its chunks (arrival times) and the
    server's usage and `pipeinfer` extension."""
    rec["text"] = "".join(pieces)
    rec["n_chunks"] = len(arrivals)
    if arrivals:
        rec["ttft_s"] = arrivals[0] - start
        rec["itl_ms"] = [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals)]
    if extension and isinstance(extension.get("tokens"), list):
        rec["tokens"] = extension["tokens"]
    if usage is not None and usage.completion_tokens is not None:
        rec["completion_tokens"], rec["tokens_counted_by"] = usage.completion_tokens, "usage"
    elif rec["tokens"] is not None:
        rec["completion_tokens"], rec["tokens_counted_by"] = len(rec["tokens"]), "token_ids"
    elif rec["error"] is None:
        rec["completion_tokens"], rec["tokens_counted_by"] = len(arrivals), "chunks"
    rec["decode_tok_per_s"] = decode_tok_per_s(rec["completion_tokens"], arrivals[0] if arrivals else None,
                                               arrivals[-1] if arrivals else None)


async def run_level(client, requests: list[LoadRequest], level: int, sampling: Sampling,
                    on_record: Callable[[dict], None] | None = None) -> tuple[list[dict], float, int]:
    """Closed loop: `level` workers take the next request as soon as their previous one ended.
    Returns (records in completion order, wall time from the first start to the last end, most
    requests seen in flight at once)."""
    records: list[dict] = []
    todo = iter(enumerate(requests))
    in_flight = peak = 0
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal in_flight, peak
        for index, req in todo:  # one shared iterator: each next() happens between two awaits
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                rec = await one_request(client, req, sampling, level, t0, index)
            finally:
                in_flight -= 1
            records.append(rec)
            if on_record:
                on_record(rec)

    await asyncio.gather(*(worker() for _ in range(min(level, len(requests)))))
    return records, time.perf_counter() - t0, peak


@dataclass
class LoadResult:
    records: list[dict]  # run order: warmups, then every (mode, level) in turn
    walls: dict[tuple[str, int], float]
    peaks: dict[tuple[str, int], int]


async def run_load(base_url: str, prompts: list[BenchPrompt], modes: list[str], levels: list[int], repeat: int,
                   warmup: int, sampling: Sampling, *, check_server: Callable[[], None] = lambda: None,
                   on_level: Callable[[str, int, int, bool], None] | None = None,
                   on_record: Callable[[dict], None] | None = None,
                   on_level_done: Callable[[str, int, list[dict], float], None] | None = None) -> LoadResult:
    """For each mode: its warmup requests (one at a time, left out of the statistics), then each level.
    on_level(mode, level, requests, warmup) before a level, on_record(record) after each request,
    on_level_done(mode, level, records, wall_s) after a measured level."""
    from openai import AsyncOpenAI

    result = LoadResult([], {}, {})
    async with AsyncOpenAI(base_url=base_url, api_key="pipeinfer-bench", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S) as client:
        for mode in modes:
            warm = [LoadRequest(prompts[w % len(prompts)], mode, w, warmup=True) for w in range(warmup)]
            if warm:
                check_server()
                if on_level:
                    on_level(mode, 1, len(warm), True)
                records, _, _ = await run_level(client, warm, 1, sampling, on_record)
                result.records += records
            for level in levels:
                check_server()
                reqs = level_requests(prompts, mode, repeat)
                if on_level:
                    on_level(mode, level, len(reqs), False)
                records, wall, peak = await run_level(client, reqs, level, sampling, on_record)
                result.records += records
                result.walls[(mode, level)], result.peaks[(mode, level)] = wall, peak
                if on_level_done:
                    on_level_done(mode, level, records, wall)
    return result


def short_record(rec: dict) -> str:
    """A request in one line of progress."""
    if rec["error"] is not None:
        return f"{rec['prompt_id']}: FAILED ({rec['error']})"
    ttft = f", TTFT {rec['ttft_s'] * 1e3:.0f} ms" if rec["ttft_s"] is not None else ""
    return f"{rec['prompt_id']}: {plural(rec['completion_tokens'] or 0, 'token')}{ttft}"

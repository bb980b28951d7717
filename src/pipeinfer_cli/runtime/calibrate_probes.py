"""The timings `pipeinfer calibrate` takes on one rank (calibrate.py runs them on every rank of a job).

Everything is timed on probe engines, independent of the job's layer split:

- the layers: a `LayerEngine` on the k layers just before the last one, holding about PROBE_BYTES
  of weights (QUICK_PROBE_BYTES with --quick; at least 1 layer), fed rows of a random table as
  hidden states as a middle stage is, timed for batch-invariant runs of r rows at KV length kv
  (decoding, verification of r-1 drafted tokens) and for prompt chunks; seconds per layer;
- the output: an engine on the last layer alone (with the final norm and the LM head), its
  runs with every row an output row against the per-layer cost of the same run, plus the sampler;
- the fixed cost of a run: the head's real iterative loop (`Pipeline` on one stage, the request
  runner `decode/request.py`) over the last-layer engine, wall time minus the engine's and the sampler's;
- the draft: a GGUF draft's prompt pass and proposals (`LlamaDrafter`), or prompt lookup;
- the host: name, CPU model, logical CPUs, memory.

With one thread a compute probe is timed in the process's CPU time over the rank's CPU share
(`ProbeSpec.now`), so that other hosts' work on the same cores (an emulated cluster) is not counted.
Each point is the median of at least `reps` timed repetitions after `warmup` untimed ones, the
points of a grid interleaved repetition by repetition, so that a slow spell of the machine spreads
over them; rounds are added, up to `max_reps`, while a point's repeats disagree
(calibrate_noise.py), and the worst spread of each quantity is kept in the rank's costs.

The probe's layers and the last layer are one contiguous range ending at the last layer, so a rank
without the model is sent one slice (with the embedding table only where the LM head is tied to it;
the head streams it, or the whole file when that is no larger). `model_path` is a file holding the
probe's layers, `last_path` one holding the last layer (the same slice, or the model file).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..decode.draft_spec import DraftSpec
from ..decode.sampling import SamplingParams, sample_rows
from ..decode.modes import ITERATIVE
from ..decode.request import Streaming, run_request
from ..decode.session import CANONICAL_SEQ, PREFILL_CHUNK, DecodeOptions
from ..decode.trace import TraceRecorder
from ..planner.profile import CostGrid, DraftCosts, LinkCosts, RankCosts
from ..transport.faults import slowdown_for
from ..wording import plural
from .calibrate_noise import SPREAD_LIMIT, NoiseLog, repeat_until_settled
from .host_facts import host_facts
from .pipeline import Pipeline

IDLE_GAP_S = 0.025  # a stage's wait before it computes, as idle_gap.py measured it (BENCHMARKS.md)
PROBE_BYTES = 512 * 2**20  # weights of the layer probe: enough layers that one eval is well above timer noise
QUICK_PROBE_BYTES = 128 * 2**20  # --quick: a quarter (still tens of ms per eval on a core), a quarter to send
KV_LENGTHS = (16, 256, 1024)  # KV lengths of the decode grid (those that fit --ctx)
QUICK_KV = (16, 512)  # --quick: two, for a shorter fill
PREFILL_ROWS = (16, 64, 256)  # prompt chunk sizes (256 = PREFILL_CHUNK, the chunk every prefill uses)
EXTRA_ROWS = (6, 8, 12, 16, 24, 32, 48, 64)  # rows beyond n_draft + 1, up to 2 n_draft (trees, long runs)
KV_PAD = 256  # the engine attends over the used cells rounded up to this (kv_cache.cpp, n_kv)
LINK_ROWS = (1, 8, 64, 256)  # message sizes of the link probe, in rows of n_embd float32


@dataclass(frozen=True)
class ProbeSpec:
    """What to time on every rank, and how often (the same on every rank)."""

    model_path: str  # a file holding the probe's layers (the model, or a streamed slice)
    n_ctx: int  # the job's --ctx: caps the KV lengths and chunk sizes
    n_draft: int  # --n-draft: decode rows go 1 .. n_draft + 1, then a few beyond
    reps: int  # timed repetitions per point (the median is kept)
    warmup: int  # untimed repetitions first
    overhead_tokens: int  # tokens of the head loop timed for the per-run overhead
    draft: DraftSpec = field(default_factory=DraftSpec.none)  # the job's --draft
    draft_path: str | None = None
    draft_prompt: int = 256  # tokens of the draft's timed prompt pass
    draft_proposals: int = 8  # timed proposals of n_draft tokens
    link_reps: int = 30  # timed round trips per message size
    kv_points: tuple[int, ...] = KV_LENGTHS  # KV lengths of the decode grid, before --ctx caps them
    extra_rows: bool = True  # rows beyond n_draft + 1 too (EXTRA_ROWS); else the planner extrapolates
    prefill_reps: int = 3  # timed prompt chunks of each size (long runs, warmed up by the fills)
    idle_gap_s: float = 0.0  # sleep before each timed eval: a stage of a pipeline computes after a wait
    max_reps: int = 0  # timed repetitions at most while the repeats disagree (below reps: reps)
    prefill_max_reps: int = 0  # the same for the prompt chunks
    spread_limit: float = SPREAD_LIMIT  # (median - best) / best above which a point is repeated
    last_path: str | None = None  # a file holding the last layer; None: model_path
    probe_bytes: int = PROBE_BYTES  # weights of the layer probe (probe_layers)
    # The rank's CPU share when its compute probes are timed in CPU time (`probe_clock_share`);
    # None: in wall time. Set by measure_rank on each rank.
    cpu_share: float | None = None

    def now(self) -> float:
        """The clock of the compute probes: with one thread, the process's CPU time over the rank's
        CPU share, so that what other processes do on the same cores (another emulated host, a
        neighbour's job) does not count; with more, wall time (threads also spin)."""
        return time.perf_counter() if self.cpu_share is None else time.process_time() / self.cpu_share

    @property
    def decode_rows(self) -> list[int]:
        extra = {r for r in EXTRA_ROWS if r <= 2 * self.n_draft} if self.extra_rows else set()
        rows = sorted(set(range(1, self.n_draft + 2)) | extra)
        return [r for r in rows if r < self.n_ctx] or [1]

    @property
    def kv_lengths(self) -> list[int]:
        top = max(self.decode_rows)
        return [k for k in self.kv_points if k + top <= self.n_ctx] or [max(1, self.n_ctx - top)]

    @property
    def prefill_rows(self) -> list[int]:
        return [r for r in PREFILL_ROWS if r <= self.n_ctx] or [self.n_ctx]

    def probe_ctx(self) -> int:
        """KV cells of a probe: the largest point, rounded up as the engine pads, within --ctx."""
        need = max(max(self.kv_lengths) + max(self.decode_rows), max(self.prefill_rows))
        return min(self.n_ctx, -(-need // KV_PAD) * KV_PAD)


def probe_clock_share(threads: int, usable_cpus: float) -> float | None:
    """ProbeSpec.cpu_share for a rank computing with `threads` threads and `usable_cpus` CPUs to use
    (the smaller of its affinity and a CFS quota): a single-threaded probe computes on its thread
    alone, so its wall time on a quiet host is its CPU time, or that over the quota below one CPU."""
    return min(1.0, usable_cpus) if threads == 1 and usable_cpus > 0 else None


def probe_layers(layer_bytes: list[int], budget: int = PROBE_BYTES) -> tuple[int, int]:
    """[n - 1 - k, n - 1): the k layers just before the last one that hold about `budget` bytes,
    1 <= k <= n - 1 (a 1-layer model: [0, 1)). With the last layer they form one range ending at
    it: one slice to send a rank without the model."""
    n = len(layer_bytes)
    if n < 2:
        return 0, n
    k, total = 0, 0
    while k < n - 1 and (k == 0 or total + layer_bytes[n - 2 - k] <= budget):
        total += layer_bytes[n - 2 - k]
        k += 1
    return n - 1 - k, n - 1


def _timed(spec: ProbeSpec, points: list, once: Callable[[object], float], noise: NoiseLog | None, what: str,
           prompt: bool = False) -> list[float]:
    """The medians of the points, repeated until they settle (calibrate_noise.py); the worst spread
    goes to `noise` under `what`. prompt: the prompt chunks' repetitions (no warm-up: the fills were
    prompt chunks already)."""
    reps, warmup, most = ((spec.prefill_reps, 0, spec.prefill_max_reps) if prompt
                          else (spec.reps, spec.warmup, spec.max_reps))
    timed = repeat_until_settled(points, once, reps, warmup, most, spec.spread_limit)
    if noise is not None:
        noise.add(what, timed)
    return timed.medians


def _fill(eng, kv: int, tokens: Callable[[int], np.ndarray], start: int = 0) -> None:
    """Cells start..kv-1 of sequence 0 (an empty cache first when start is 0), in prompt chunks."""
    if start == 0:
        eng.kv_clear()
    for b in range(start, kv, PREFILL_CHUNK):
        n = min(PREFILL_CHUNK, kv - b)
        eng.eval(tokens=tokens(n), pos=np.arange(b, b + n, dtype=np.int32), seq_ids=[[CANONICAL_SEQ]] * n,
                 batch_invariant=False)


def _timed_eval(eng, rows: int, at: int, tokens: Callable[[int], np.ndarray], invariant: bool,
                gap_s: float, clock: Callable[[], float]) -> float:
    """Seconds of one eval of `rows` tokens at positions at.. of sequence 0, rolled back afterwards.

    gap_s: sleep first. On several ranks every stage computes after waiting for its input, and on
    this kind of machine the same layers compute 5-13 % slower after a 25 ms sleep than back to
    back (BENCHMARKS.md, "A gap between two computations"); timing them back to back would
    predict too fast a pipeline."""
    toks, pos = tokens(rows), np.arange(at, at + rows, dtype=np.int32)
    if gap_s > 0:
        time.sleep(gap_s)
    t0 = clock()
    eng.eval(tokens=toks, pos=pos, seq_ids=[[CANONICAL_SEQ]] * rows, batch_invariant=invariant)
    dt = clock() - t0
    eng.seq_rm(CANONICAL_SEQ, at, -1)
    return dt


def _tokens(n_vocab: int, seed: int) -> Callable[[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    return lambda k: rng.integers(0, n_vocab, k, dtype=np.int32)


def non_decreasing(costs: list[float]) -> list[float]:
    """Costs by ascending batch rows, each at most the next one's. A batch-invariant run of r rows
    computes r one-row evaluations, so it never costs less than a run of fewer rows: a point above a
    larger batch's is a spell of the machine's (another process, a page fault) caught by the few
    repetitions of --quick, and the larger batch's time bounds it."""
    out = list(costs)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def layer_costs(spec: ProbeSpec, eng, n_vocab: int, noise: NoiseLog | None = None) -> tuple[CostGrid, CostGrid]:
    """(decode grid, prefill grid): seconds per layer, on the layer probe `eng`."""
    n = eng.layer_end - eng.layer_begin
    tokens = _tokens(n_vocab, 0)
    rows, kvs, pre = spec.decode_rows, spec.kv_lengths, spec.prefill_rows
    decode, filled = [], 0
    for kv in kvs:  # ascending: each KV length extends the last one's cells (timed runs roll back)
        _fill(eng, kv, tokens, filled)
        filled = kv
        secs = _timed(spec, rows, lambda r, kv=kv: _timed_eval(eng, r, kv, tokens, True, spec.idle_gap_s, spec.now), noise,
                      "decode")
        decode.append(non_decreasing([s / n for s in secs]))
    eng.kv_clear()
    secs = _timed(spec, pre, lambda r: _timed_eval(eng, r, 0, tokens, False, spec.idle_gap_s, spec.now), noise, "prefill",
                  prompt=True)
    eng.kv_clear()
    return CostGrid(rows, kvs, decode), CostGrid(pre, [0], [[s / n for s in secs]])


class _EmbeddingFront:
    """An engine of layers past the first (the last layer, the layer probe) as a first stage: token
    ids in, rows of a small random table as its hidden states (so that the head's loop can run over
    it). Keeps the seconds of every eval."""

    def __init__(self, eng, n_embd: int, clock: Callable[[], float]):
        self.eng, self.clock = eng, clock
        self.table = np.random.default_rng(1).standard_normal((256, n_embd)).astype(np.float32)
        self.evals: list[float] = []

    def eval(self, tokens, pos, seq_ids, output=None, batch_invariant=False):
        embd = self.table[np.asarray(tokens, np.int64) % len(self.table)]
        t0 = self.clock()
        out = self.eng.eval(embd=embd, pos=pos, seq_ids=seq_ids, output=output, batch_invariant=batch_invariant)
        self.evals.append(self.clock() - t0)
        return out

    def __getattr__(self, name):  # kv_used_cells, seq_rm, kv_clear, ...
        return getattr(self.eng, name)


def head_seconds(spec: ProbeSpec, last, probe, n_vocab: int, rows: int, kv: int, noise: NoiseLog | None = None) -> float:
    """Seconds per output row of the final norm and LM head: a run of `rows` rows, every one an
    output row, on the last layer (`last`, a _EmbeddingFront), less one layer of the same run timed
    on the layer probe in the same rounds (interleaved, so that a busy spell of the machine weighs
    on both alike)."""
    n = probe.layer_end - probe.layer_begin
    tokens = _tokens(n_vocab, 5)
    _fill(last, kv, tokens)
    _fill(probe, kv, tokens)

    def once(which: str) -> float:
        if which == "layer":
            return _timed_eval(probe, rows, kv, tokens, True, spec.idle_gap_s, spec.now) / n
        if spec.idle_gap_s > 0:
            time.sleep(spec.idle_gap_s)
        t0 = spec.now()
        last.eval(tokens(rows), np.arange(kv, kv + rows, dtype=np.int32), [[CANONICAL_SEQ]] * rows,
                  output=np.ones(rows, bool), batch_invariant=True)
        dt = spec.now() - t0
        last.seq_rm(CANONICAL_SEQ, kv, -1)
        return dt

    t_out, t_layer = _timed(spec, ["output", "layer"], once, noise, "output")
    return max(0.0, t_out - t_layer) / rows


def sampler_seconds(spec: ProbeSpec, last, rows: int, kv: int, sampling: SamplingParams) -> float:
    """Seconds per row of `sample_rows` on real logits of the last layer (`last`, a _EmbeddingFront)."""
    logits = last.eval(np.arange(rows), np.arange(kv, kv + rows, dtype=np.int32), [[CANONICAL_SEQ]] * rows,
                       output=np.ones(rows, bool), batch_invariant=True)
    last.seq_rm(CANONICAL_SEQ, kv, -1)
    positions = np.arange(kv + 1, kv + 1 + rows)

    def once(_):
        t0 = spec.now()
        sample_rows(logits, sampling, positions)
        return spec.now() - t0

    return repeat_until_settled([0], once, spec.reps * 3, spec.warmup).medians[0] / rows


def run_overhead(front: _EmbeddingFront, n_vocab: int, n_tokens: int, sampling: SamplingParams,
                 sample_s: float) -> float:
    """The head's fixed seconds per run beyond its engine and the sampler: its real iterative loop
    (Pipeline on one stage, the request runner in iterative mode) for n_tokens tokens; per run, the time from
    one commit to the next less the run's eval, the median, less the sampler's share. That is
    Python's part of every run (launch, result, commit, the run's bookkeeping); on a stage with
    neighbours, MPI's sends and probes come on top, and the link probe measures those."""
    pipe = Pipeline(None, front, 1, TraceRecorder(0))
    front.kv_clear()
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, n_vocab, 16)]
    commits: list[float] = []
    run_request(pipe, ITERATIVE.name, prompt, DecodeOptions(), None, sampling=sampling, n_predict=n_tokens + 1,
                is_eog=lambda _t: False, streaming=Streaming(on_token=lambda _t: commits.append(front.clock())))
    front.kv_clear()
    gaps = np.diff(commits)  # one decode run each, whose eval is among the last ones
    per_run = gaps - np.asarray(front.evals[len(front.evals) - len(gaps):])
    return max(0.0, float(np.median(per_run)) - sample_s)


def draft_costs(spec: ProbeSpec, rank: int, threads: int) -> DraftCosts:
    """The draft's seconds per proposed token and per token of its prompt pass, on this rank."""
    if spec.draft.is_lookup:
        return _lookup_costs(spec, rank)
    from .draft_setup import local_drafter

    drafter = local_drafter(spec.draft, spec.draft_path, spec.n_ctx, threads)
    try:
        rng = np.random.default_rng(3)
        n_prompt = max(1, min(spec.draft_prompt, spec.n_ctx - (spec.draft_proposals + 2) * (spec.n_draft + 1)))

        def prompt(k: int) -> list[int]:
            return [int(t) for t in rng.integers(0, drafter.n_vocab, k)]

        drafter.start(prompt(min(16, n_prompt)))  # warm-up: the first eval allocates
        path = prompt(n_prompt)
        t0 = spec.now()
        drafter.start(path)
        prompt_s = (spec.now() - t0) / n_prompt
        per_token = []
        for i in range(spec.draft_proposals + 1):
            t0 = spec.now()
            prop = drafter.propose(path, spec.n_draft, 0.0)
            dt = spec.now() - t0
            if i > 0:  # the first one warms up
                per_token.append(dt / max(1, len(prop.tokens)))
            path = path + prop.tokens  # as if every token was accepted: n_draft evals per proposal
    finally:
        drafter.close()
    return DraftCosts("model", spec.draft.label, rank, threads, statistics.median(per_token), prompt_s)


def _lookup_costs(spec: ProbeSpec, rank: int) -> DraftCosts:
    """Prompt lookup: a path of 1,000 tokens that repeats itself, so that every proposal is full."""
    from .draft_setup import lookup_drafter

    drafter = lookup_drafter()
    base = [int(t) for t in np.random.default_rng(4).integers(0, 32000, 500)]
    path = base + base

    def once(_):
        t0 = spec.now()
        prop = drafter.propose(path, spec.n_draft, 0.0)
        return (spec.now() - t0) / max(1, len(prop.tokens))

    token_s = repeat_until_settled([0], once, spec.reps * 5, spec.warmup).medians[0]
    return DraftCosts("lookup", "lookup", rank, 1, token_s, 0.0)


def measure_rank(spec: ProbeSpec, info, rank: int, threads: int, runs_draft: bool, sampling: SamplingParams,
                 say: Callable[[str], None]) -> tuple[RankCosts, DraftCosts | None]:
    """Every timing of one rank (the module doc); say(line) reports each phase as it starts."""
    from ..native import LayerEngine

    facts = host_facts()
    spec = replace(spec, cpu_share=probe_clock_share(threads, facts.usable_cpus))
    begin, end = probe_layers(info.layer_bytes, spec.probe_bytes)
    say(f"layers {begin}-{end - 1} ({sum(info.layer_bytes[begin:end]) / 1e6:.0f} MB), {plural(threads, 'thread')}: "
        f"{len(spec.decode_rows)} batch sizes x KV {'/'.join(map(str, spec.kv_lengths))}, prompt chunks "
        f"{'/'.join(map(str, spec.prefill_rows))}")
    slow = slowdown_for(rank)  # PIPEINFER_DEBUG_SLOW: an emulated slower node is measured as such
    probe = LayerEngine(spec.model_path, begin, end, n_ctx=spec.probe_ctx(), n_threads=threads, n_seq_max=2,
                        slowdown=slow)
    if begin > 0:  # a middle range: hidden states in, as a middle stage gets them
        probe = _EmbeddingFront(probe, info.n_embd, spec.now)
    noise = NoiseLog(spec.spread_limit)
    decode, prefill_grid = layer_costs(spec, probe, info.n_vocab, noise)
    say(f"output rows and per-run overhead on layer {info.n_layer - 1}")
    last = _EmbeddingFront(LayerEngine(spec.last_path or spec.model_path, info.n_layer - 1, info.n_layer, n_ctx=spec.probe_ctx(),
                                       n_threads=threads, n_seq_max=2, slowdown=slow), info.n_embd, spec.now)
    rows, kv = max(r for r in decode.rows if r <= spec.n_draft + 1), decode.kv[0]
    head_s = head_seconds(spec, last, probe, info.n_vocab, rows, kv, noise)
    del probe
    sample_s = sampler_seconds(spec, last, rows, kv, sampling)
    overhead_s = run_overhead(last, info.n_vocab, spec.overhead_tokens, sampling, sample_s)
    del last
    draft = None
    if runs_draft:
        say(f"draft {spec.draft.label}")
        draft = draft_costs(spec, rank, threads)
    costs = RankCosts(rank=rank, threads=threads, decode=decode, prefill=prefill_grid, output_row_s=head_s + sample_s,
                      run_overhead_s=overhead_s, probe_layers=[begin, end], spread=dict(noise.worst),
                      omp_wait=os.environ.get("OMP_WAIT_POLICY", "default"), **facts.as_dict())
    return costs, draft


def fit_link(src: int, dst: int, n_embd: int, rtt: dict[int, float]) -> LinkCosts:
    """Latency and bandwidth of src -> dst from round trips: rtt[rows] is the median time of a
    message of rows x n_embd float32 there and one row back. The way back is taken as half the
    one-row round trip, and one-way time = latency + bytes / bandwidth is fitted by least squares."""
    back = rtt[min(rtt)] / 2
    xs = np.asarray([r * n_embd * 4 for r in sorted(rtt)], float)
    ys = np.asarray([rtt[r] - back for r in sorted(rtt)], float)
    if len(xs) > 1 and np.ptp(xs) > 0:
        slope, intercept = np.polyfit(xs, ys, 1)
    else:
        slope, intercept = 0.0, float(ys[0])
    # Noise can tilt a fit of near-equal times flat or downwards: the bandwidth is then what the
    # largest message showed on its own.
    bandwidth = 1.0 / float(slope) if slope > 1e-12 else float(xs[-1] / max(ys[-1], 1e-9))
    return LinkCosts(src, dst, max(0.0, float(intercept)), bandwidth)

"""How much `pipeinfer calibrate` can trust a figure: repeat until the repeats agree, and compare
ranks that run on the same hardware.

A figure is the median of its timed repeats. Its spread is how far that median sits above the
best repeat, relative to the best: (median - best) / best. A quiet machine repeats a layer's
timing within a few per cent; a machine with other work on it gives a few fast repeats and many
slow ones, and the median moves with whatever else runs. So the points of a grid are timed round
after round (interleaved, as before) until every point's spread is within SPREAD_LIMIT or the
rounds reach the probe's bound; a figure still beyond the limit is reported as unreliable, and its
spread is kept in the profile (`RankCosts.spread`).

Ranks with the same machine identity (CPU model, usable CPUs, threads) should cost the same: the
head compares their one-row layer figure and names, in one line, twins that differ by more than
TWIN_MARGIN.

Pure decisions on timings: the functions take the timer as an argument, so the tests drive them
with made-up timings.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..wording import plural

SPREAD_LIMIT = 0.10  # a figure is settled when its median is within 10 % of its best repeat
TWIN_MARGIN = 0.25  # ranks of one machine identity whose one-row figures differ by more are named


def spread(times: Sequence[float]) -> float:
    """(median - best) / best of a point's timed repeats; 0 for fewer than two repeats."""
    if len(times) < 2:
        return 0.0
    best = min(times)
    return (statistics.median(times) - best) / best if best > 0 else 0.0


@dataclass
class Timed:
    """The points' figures (medians), their spreads, and the timed rounds it took."""

    medians: list[float]
    spreads: list[float]
    rounds: int

    @property
    def worst(self) -> float:
        return max(self.spreads, default=0.0)


def repeat_until_settled(points: list, once: Callable[[object], float], reps: int, warmup: int,
                         max_reps: int | None = None, limit: float = SPREAD_LIMIT) -> Timed:
    """Time every point once per round: `warmup` untimed rounds, `reps` timed ones, then one more
    round at a time while some point's spread exceeds `limit`, up to `max_reps` timed rounds in all
    (None or fewer than reps: exactly reps)."""
    bound = max(reps, max_reps or 0)
    times: list[list[float]] = [[] for _ in points]
    done = 0
    for i in range(warmup + bound):
        for j, p in enumerate(points):
            t = once(p)
            if i >= warmup:
                times[j].append(t)
        if i >= warmup:
            done += 1
            if done >= reps and max(spread(t) for t in times) <= limit:
                break
    return Timed([statistics.median(t) for t in times], [spread(t) for t in times], done)


@dataclass
class NoiseLog:
    """The worst spread of each measured quantity on one rank (e.g. "decode", "prefill", "output")."""

    limit: float = SPREAD_LIMIT
    worst: dict[str, float] = field(default_factory=dict)

    def add(self, what: str, timed: Timed) -> None:
        self.worst[what] = round(max(self.worst.get(what, 0.0), timed.worst), 4)

    def unsettled(self) -> dict[str, float]:
        return {k: v for k, v in self.worst.items() if v > self.limit}


def unreliable_line(rank: int, spreads: dict[str, float] | None, limit: float = SPREAD_LIMIT) -> str | None:
    """One line when some of a rank's figures stayed beyond the limit after every repeat, else None."""
    bad = {k: v for k, v in (spreads or {}).items() if v > limit}
    if not bad:
        return None
    what = ", ".join(f"{k} {v * 100:.0f} %" for k, v in bad.items())
    return (f"rank {rank}: figures stayed unreliable after the most repeats allowed (spread {what}; limit "
            f"{limit * 100:.0f} %): the machine was busy; calibrate again on a quiet machine before planning with them")


def machine_identity(rank) -> tuple:
    """What makes two ranks the same hardware for a calibration: CPU model, usable CPUs, threads."""
    return (rank.cpu, rank.usable_cpus, rank.threads)


def one_row_s(rank) -> float:
    """The figure twins are compared by: seconds per layer of one row at the first KV length."""
    return rank.decode.s[0][0]


def twin_disagreements(ranks: Sequence, margin: float = TWIN_MARGIN) -> list[str]:
    """One line per group of ranks with one machine identity whose one-row figures differ by more
    than `margin` (slowest / fastest - 1), naming the ranks and their figures."""
    groups: dict[tuple, list] = {}
    for r in ranks:
        groups.setdefault(machine_identity(r), []).append(r)
    out = []
    for (cpu, usable, threads), members in groups.items():
        if len(members) < 2:
            continue
        figures = [one_row_s(r) for r in members]
        lo, hi = min(figures), max(figures)
        if lo <= 0 or hi / lo - 1 <= margin:
            continue
        names = ", ".join(str(r.rank) for r in members)
        ms = ", ".join(f"{f * 1e3:.3f}" for f in figures)
        usable_txt = "?" if usable is None else f"{usable:g}"
        out.append(f"ranks {names} run on the same hardware ({cpu}, {usable_txt} usable CPUs, {plural(threads, 'thread')}) but "
                   f"measured {ms} ms per layer (1 row, KV {members[0].decode.kv[0]}), {hi / lo - 1:.0%} apart "
                   f"(more than {margin:.0%}): a busy machine or a host that differs; calibrate again before a "
                   "--layer-split auto follows these figures")
    return out

"""The order in which a benchmark runs its requests.

Modes are interleaved at the innermost level (A, B, C, A, B, C …) so that machine drift — thermal
state, a neighbour's job, page cache — hits every mode alike. Warmup rounds come first (one round =
every mode on one prompt, cycling through the prompts); the measured repeats then sweep all the
prompts once per repeat, so repeats of one prompt are spread over the whole job rather than bunched.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prompts import BenchPrompt


@dataclass(frozen=True)
class BenchItem:
    """One request of the benchmark."""

    index: int  # position in the schedule
    prompt: BenchPrompt
    mode: str
    repeat: int  # 0-based; counts warmup and measured rounds separately
    warmup: bool  # excluded from statistics (still checked for token equality)


def build_schedule(prompts: list[BenchPrompt], modes: list[str], repeat: int, warmup: int) -> list[BenchItem]:
    items: list[BenchItem] = []

    def add(p: BenchPrompt, rep: int, is_warmup: bool) -> None:
        for mode in modes:
            items.append(BenchItem(len(items), p, mode, rep, is_warmup))

    for w in range(warmup):
        add(prompts[w % len(prompts)], w, True)
    for rep in range(repeat):
        for p in prompts:
            add(p, rep, False)
    return items

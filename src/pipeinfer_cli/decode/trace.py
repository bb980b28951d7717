"""Per-rank timeline events (slices and instants), gathered by the head for `--trace`.

Recording is a list append, cheap enough to stay on; times are this rank's perf_counter and are
shifted onto the head's clock with the offset measured at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TraceRecorder:
    rank: int
    events: list[tuple] = field(default_factory=list)  # (kind, name, t0, t1, args)

    def slice(self, name: str, t0: float, t1: float, **args) -> None:
        self.events.append(("X", name, t0, t1, args))

    def instant(self, name: str, t: float, **args) -> None:
        self.events.append(("i", name, t, t, args))

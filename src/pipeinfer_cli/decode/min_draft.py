"""llama.cpp's `--draft-min`: a draft shorter than n_min tokens is not verified.

A short draft costs a verification run that can win at most a token or two; below n_min the
drafter's proposal is dropped (an empty proposal), so the mode runs its one-token step instead.
The drafter itself is unchanged: `MinLengthDrafter` wraps it, for the synchronous `propose` and for
a draft rank's asynchronous `poll`, and forwards everything else.
"""

from __future__ import annotations

from .drafters import AsyncDrafter, Drafter, Proposal


class MinLengthDrafter:
    def __init__(self, inner, n_min: int):
        self._inner, self.n_min = inner, n_min

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _keep(self, prop: Proposal | None) -> Proposal | None:
        if prop is None or len(prop.tokens) >= self.n_min:
            return prop
        return Proposal([], [], [], base=prop.base, source=prop.source)

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        return self._keep(self._inner.propose(path, n_max, p_min))

    def poll(self) -> Proposal | None:
        return self._keep(self._inner.poll())


def with_min_length(drafter: Drafter | AsyncDrafter | None, n_min: int) -> Drafter | AsyncDrafter | None:
    """The drafter, wrapped when n_min asks for more than one token."""
    return drafter if drafter is None or n_min <= 1 else MinLengthDrafter(drafter, n_min)

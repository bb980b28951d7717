"""--layer-split fractions to layer ranges: every stage gets at least one real layer, whatever the
rounding (fractions near 0 and 1, every layer count)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeinfer_cli.planner.layout import parse_layer_split, ranges_from_fractions
from pipeinfer_cli.errors import UsageError


def check_ranges(ranges: list[tuple[int, int]], n_stages: int, n_layer: int) -> None:
    assert len(ranges) == n_stages
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
    for (b, e), (b2, _) in zip(ranges, ranges[1:]):
        assert e == b2  # consecutive
    assert all(e - b >= 1 for b, e in ranges), ranges


@pytest.mark.parametrize("split, want", [
    ("0.99,0.01", [(0, 29), (29, 30)]),
    ("0.999,0.001", [(0, 29), (29, 30)]),
    ("0.01,0.99", [(0, 1), (1, 30)]),
    ("0.5,0.49,0.01", [(0, 15), (15, 29), (29, 30)]),
    ("0.001,0.001,0.998", [(0, 1), (1, 2), (2, 30)]),
    ("0.5,0.5", [(0, 15), (15, 30)]),
])
def test_the_reported_uneven_splits(split, want):
    fractions, _ = parse_layer_split(split)
    assert ranges_from_fractions(fractions, 30) == want


@settings(max_examples=400, deadline=None)
@given(n_layer=st.integers(1, 120),
       raw=st.lists(st.one_of(st.floats(1e-6, 1e-2), st.floats(0.9, 1.0), st.floats(1e-3, 1.0)),
                    min_size=1, max_size=12))
def test_every_stage_gets_a_layer(n_layer, raw):
    fractions = [f / sum(raw) for f in raw]
    if len(fractions) > n_layer:
        with pytest.raises(UsageError, match="at most"):
            ranges_from_fractions(fractions, n_layer)
        return
    check_ranges(ranges_from_fractions(fractions, n_layer), len(fractions), n_layer)


@pytest.mark.parametrize("n_layer", range(1, 65))
def test_two_stages_near_0_and_1_for_every_layer_count(n_layer):
    for small in (1e-9, 1e-4, 0.001, 0.01, 0.49, 0.5):
        for fractions in ([1 - small, small], [small, 1 - small]):
            if n_layer < 2:
                with pytest.raises(UsageError):
                    ranges_from_fractions(fractions, n_layer)
            else:
                check_ranges(ranges_from_fractions(fractions, n_layer), 2, n_layer)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(UsageError, match="only 3 layers"):
        ranges_from_fractions([0.25] * 4, 3)

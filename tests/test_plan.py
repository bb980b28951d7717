"""The planner: virtual-time predictions from a profile, checked against arithmetic that is known,
and the profile and trace files' checks."""

from __future__ import annotations

import json

import pytest

from planning import make_profile, prompt_trace, rank_costs
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.planner.predict import Topology, predict
from pipeinfer_cli.planner.profile import Profile, ProfileError
from pipeinfer_cli.planner.replay import ChainIndex, SyntheticChains, Trace, TraceError


def split(n_ranks: int, n_layer: int = 20) -> list[tuple[int, int]]:
    per = n_layer // n_ranks
    return [(i * per, (i + 1) * per if i < n_ranks - 1 else n_layer) for i in range(n_ranks)]


@pytest.mark.parametrize("n_ranks", [1, 2, 4])
def test_iterative_is_one_token_per_full_pass(n_ranks):
    lat = 1e-4
    prof = make_profile(n_ranks, latency_s=lat)
    pt = prompt_trace()
    r = predict(prof, Topology(list(range(n_ranks)), split(n_ranks)), "iterative", pt, DecodeOptions())
    # 20 layers of 1 ms, plus one link per hop and the way back to the head.
    per_token = 20e-3 + (n_ranks * lat if n_ranks > 1 else 0.0)
    assert r.n_gen == len(pt.tokens)
    assert r.decode_tok_per_s == pytest.approx(1 / per_token, rel=1e-3)


def test_perfect_free_draft_with_free_verification_gives_k_plus_one_per_pass():
    prof = make_profile(1, ranks=[rank_costs(0, per_row=0.0)], draft_token_s=0.0)
    pt = prompt_trace(n_gen=41)  # 1 + 8 passes of 5 tokens
    opts = DecodeOptions(n_draft=4)
    r = predict(prof, Topology([0], split(1), "head"), "speculative", pt, opts, SyntheticChains(pt, 1.0, 24))
    assert r.acceptance["rate"] == 1.0
    assert r.decode_tok_per_s == pytest.approx(5 / 20e-3, rel=0.01)


def test_verification_that_costs_k_decodes_gains_nothing_on_one_stage():
    """The machine this project is measured on: k rows cost about k one-row runs."""
    prof = make_profile(1, ranks=[rank_costs(0, per_row=None)], draft_token_s=0.0)
    pt = prompt_trace()
    it = predict(prof, Topology([0], split(1)), "iterative", pt, DecodeOptions())
    sp = predict(prof, Topology([0], split(1), "head"), "speculative", pt, DecodeOptions(), SyntheticChains(pt, 1.0, 24))
    assert sp.decode_tok_per_s == pytest.approx(it.decode_tok_per_s, rel=0.01)


def test_predictions_are_deterministic_and_lossless():
    prof = make_profile(3, latency_s=2e-4, draft_token_s=2e-3)
    pt = prompt_trace(n_gen=64)
    topo = Topology([0, 1, 2], split(3), "head")
    runs = [predict(prof, topo, "pipeinfer", pt, DecodeOptions(), SyntheticChains(pt, 0.7, 24)).to_json()
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0]["n_gen"] == 64 and runs[0]["runs"]["cancelled"] > 0  # rejections cancel runs in flight


def test_a_faster_pipeline_of_cheap_stages_makes_pipeinfer_pay():
    """Several stages, verification nearly free per row and a cheap confident draft: pipeinfer keeps
    every stage busy and beats both baselines (the regime it is built for)."""
    ranks = [rank_costs(i, per_row=0.05e-3) for i in range(4)]
    prof = make_profile(4, ranks=ranks, latency_s=1e-4, draft_token_s=0.5e-3)
    pt = prompt_trace(n_gen=96)
    speeds = {}
    for mode in ("iterative", "speculative", "pipeinfer"):
        topo = Topology([0, 1, 2, 3], split(4), "head" if mode != "iterative" else None)
        speeds[mode] = predict(prof, topo, mode, pt, DecodeOptions(), SyntheticChains(pt, 0.8, 24)).tok_per_s
    assert speeds["pipeinfer"] > speeds["speculative"] > speeds["iterative"]


def test_replayed_chains_answer_the_draft_exactly():
    pt = prompt_trace(n_gen=6, n_prompt=3)
    full = pt.full
    pt.chains_from = 4
    pt.chains = [[full[4], full[5], 999], [full[5], 999, 998], [777, 1, 2], [full[7], full[8]], [full[8]]]
    pt.chain_probs = [[0.9, 0.8, 0.2], [0.8, 0.2, 0.1], [0.5, 0.5, 0.5], [0.9, 0.9], [0.9]]
    idx = ChainIndex(pt)
    assert idx.continuation(full[:4]) == ([full[4], full[5], 999], [0.9, 0.8, 0.2])
    assert idx.continuation(full[:6]) == ([777, 1, 2], [0.5, 0.5, 0.5])  # a committed prefix: its own chain
    assert idx.continuation(full[:6] + [999]) == ([998], [0.1])  # along the chain from prefix 5
    assert idx.continuation(full[:6] + [777]) == ([1, 2], [0.5, 0.5])
    assert idx.continuation(full[:4] + [5, 5]) == ([], []) and idx.misses == 1


def test_profile_round_trip_and_refusals(tmp_path):
    prof = make_profile(2)
    path = tmp_path / "p.json"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof
    d = json.loads(path.read_text())
    del d["ranks"][0]["decode"]
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="incomplete or malformed"):
        Profile.load(path)
    d = json.loads(prof.to_json())
    d["ranks"][1]["decode"]["s"][0][0] = -1.0
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="rank 1's decode costs"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="no profile at"):
        Profile.load(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="measured for test-model .* not other"):
        prof.check_model("other", 1234)
    (tmp_path / "bad.trace").write_text("{}")
    with pytest.raises(TraceError, match="not a pipeinfer trace"):
        Trace.load(tmp_path / "bad.trace")


def test_auto_split_gives_a_slower_rank_fewer_layers():
    from pipeinfer_cli.planner.split import auto_split

    equal = make_profile(2, n_layer=24)
    assert auto_split(equal, [0, 1]) == [(0, 12), (12, 24)]
    slow = make_profile(2, n_layer=24, ranks=[rank_costs(0), rank_costs(1, speed=0.5)])
    (b0, e0), (b1, e1) = auto_split(slow, [0, 1])
    assert e0 - b0 == 16 and e1 - b1 == 8  # twice as slow: half the layers


def test_auto_split_respects_memory_and_says_when_nothing_fits():
    from pipeinfer_cli.errors import UsageError
    from pipeinfer_cli.planner.split import auto_split

    prof = make_profile(2, n_layer=24)
    prof.ranks[1].mem_available_bytes = 700  # room for 6 layers of 100 bytes (at 90 %), the LM head included
    (_, e0), (b1, e1) = auto_split(prof, [0, 1])
    assert e1 - b1 <= 5 and e0 == b1
    prof.ranks[0].mem_available_bytes = prof.ranks[1].mem_available_bytes = 500
    with pytest.raises(UsageError, match=r"rank 1 \(host node1\) cannot hold layers 4-23: it needs 2.1 kB, it has 450 B"):
        auto_split(prof, [0, 1])


def test_layer_split_auto_in_the_job_planner(tmp_path):
    from pipeinfer_cli.errors import UsageError
    from pipeinfer_cli.planner.layout import plan_topology, split_rank_count

    assert split_rank_count("auto") is None and split_rank_count("auto/1") is None and split_rank_count("1,1/1") == 3
    slow = make_profile(2, n_layer=24, ranks=[rank_costs(0), rank_costs(1, speed=0.5)])
    topo = plan_topology(2, "auto", [100] * 24, 100, "1", 2, profile=slow)
    assert [r.layers for r in topo.ranks] == [(0, 16), (16, 24)]
    topo = plan_topology(3, "auto/1", [100] * 24, 100, "1", 3, profile=slow)
    assert topo.draft_rank == 2 and [r.layers for r in topo.ranks[:2]] == [(0, 16), (16, 24)]
    with pytest.raises(UsageError, match="needs a profile"):
        plan_topology(2, "auto", [100] * 24, 100, "1", 2)
    with pytest.raises(UsageError, match="measured 2 rank"):
        plan_topology(3, "auto", [100] * 24, 100, "1", 3, profile=slow)


def test_debug_slowdown_is_read_per_rank_and_bad_values_are_named():
    from pipeinfer_cli.errors import UsageError
    from pipeinfer_cli.transport.faults import slowdown_for

    env = {"PIPEINFER_DEBUG_SLOW": "1:2.5,3:4"}
    assert [slowdown_for(r, env) for r in range(4)] == [1.0, 2.5, 1.0, 4.0]
    assert slowdown_for(0, {}) == 1.0
    for bad in ("1", "x:2", "1:0.5", "-1:2"):
        with pytest.raises(UsageError, match="PIPEINFER_DEBUG_SLOW: cannot read"):
            slowdown_for(0, {"PIPEINFER_DEBUG_SLOW": bad})


def test_a_profile_from_another_machine_is_named_in_one_line():
    prof = make_profile(2)
    assert prof.machine_warning(1, "node1", "test cpu") is None
    w = prof.machine_warning(1, "laptop", "other cpu", "the profile p.json")
    assert w.startswith("rank 1 runs on laptop (other cpu) but the profile p.json measured it on node1 (test cpu)")
    assert "\n" not in w and prof.machine_warning(5, "x", "y") is None


def test_a_scaled_profile_keeps_the_measured_shape_at_the_new_model_s_size():
    """project_paper.py --from-profile: nodes like the measured ranks, running a model whose layers
    are 10x the measured one's and a draft 3x the measured draft."""
    from pipeinfer_cli.planner.project import ModelSpec, scaled_profile

    measured = make_profile(2, ranks=[rank_costs(0, per_row=0.5e-3, overhead_s=2e-4), rank_costs(1, per_row=None)],
                            latency_s=3e-4, bytes_per_s=1e8, draft_token_s=4e-3)
    big = ModelSpec("big", 40, 128, 1000, layer_bytes=1000, output_bytes=300, params_per_layer=1e6)
    prof = scaled_profile(measured, big, 5, draft_factor=3.0)
    assert [r.rank for r in prof.ranks] == [0, 1, 2, 3, 4] and prof.model.n_layer == 40
    # rank 2 is like measured rank 0: a tenfold layer, the same batch cost curve and fixed cost per run
    assert prof.ranks[2].decode.s[0] == pytest.approx([10e-3, 15e-3, 25e-3, 45e-3])
    assert prof.ranks[3].decode.s[0] == pytest.approx([10e-3, 20e-3, 40e-3, 80e-3])  # like measured rank 1
    assert prof.ranks[2].run_overhead_s == 2e-4
    assert prof.link(0, 4).latency_s == 3e-4 and prof.link(4, 0).bytes_per_s == 1e8
    assert prof.draft.rank == 4 and prof.draft.token_s == pytest.approx(12e-3)
    iterative = predict(prof, Topology([0, 1, 2, 3], split(4, 40)), "iterative", prompt_trace(), DecodeOptions())
    assert iterative.decode_tok_per_s == pytest.approx(1 / (40 * 10e-3 + 4 * 3e-4 + 128 * 4 / 1e8 * 4 + 4 * 2e-4),
                                                       rel=0.05)

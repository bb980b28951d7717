"""Where the job's work goes, chosen by the planner (planner/placement.py, planner/search.py): the
draft charged by the tokens it drafts, the head by its commits, the draft on the head or on a rank
of its own, a lighter head, the threads per rank; on hand-made profiles whose arithmetic is known."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from planning import make_profile, rank_costs
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.planner import search
from pipeinfer_cli.planner.placement import THREAD_SCALING, at_threads, draft_on, placements
from pipeinfer_cli.planner.plan import Replay, run_mode
from pipeinfer_cli.planner.predict import Topology
from pipeinfer_cli.planner.split import HeadLoad, JobMemory, auto_split


def hosts(n: int, usable: float = 2.0, draft_token_s: float = 1e-3, threads: int = 1, overhead_s: float = 2e-4,
          host: str | None = None):
    """n ranks of 28 layers' model, 1 ms a layer, each on a host of its own (or all on `host`)."""
    ranks = [replace(rank_costs(i, per_layer=1e-3, per_row=2e-4, overhead_s=overhead_s), threads=threads,
                     usable_cpus=usable, host=host or f"node{i}", ranks_per_host=n if host else 1)
             for i in range(n)]
    return make_profile(n, n_layer=28, ranks=ranks, draft_token_s=draft_token_s, latency_s=2e-4)


REPLAY = Replay([search.auto_request(None, 48)], 0.8)


def best_placement(prof, n: int, mode: str = "pipeinfer", replay=REPLAY, threads=None):
    cands = placements(prof, n, threads or [prof.ranks[0].threads] * n, "model", JobMemory(), HeadLoad())
    return search.search_placed(cands, mode, replay, DecodeOptions(), 4096)


def test_the_draft_on_the_head_is_charged_by_the_tokens_it_drafts():
    prof = hosts(2, draft_token_s=2e-3)
    # A draft that drafts 4 tokens per generated token weighs on the head 4 times as much as one.
    one = auto_split(prof, [0, 1], True, head=HeadLoad(draft_tokens=1.0))
    four = auto_split(prof, [0, 1], True, head=HeadLoad(draft_tokens=4.0))
    assert four[0][1] < one[0][1]
    # The simulation counts what a policy drafts: pipeinfer drafts ahead of what it commits.
    preds = run_mode(prof, Topology([0, 1], one, "head"), "pipeinfer", Replay([search.auto_request(None, 32)], 0.6),
                     DecodeOptions(), 4096)
    load = search.head_load(preds)
    assert load.draft_tokens > 1.0 and load.commits > 0


def test_the_head_pays_for_committing_a_speculative_result(monkeypatch):
    import pipeinfer_cli.planner.sim_pipeline as sim

    prof = hosts(2, overhead_s=5e-3)
    topo = Topology([0, 1], [(0, 14), (14, 28)], "head")
    rep = Replay([search.auto_request(None, 24)], 0.8)

    def speed(mode: str) -> float:
        return run_mode(prof, topo, mode, rep, DecodeOptions(), 4096)[0].tok_per_s

    charged = {m: speed(m) for m in ("iterative", "speculative", "pipeinfer")}
    monkeypatch.setattr(sim, "HEAD_COMMIT_RUNS", 0.0)
    free = {m: speed(m) for m in ("iterative", "speculative", "pipeinfer")}
    assert charged["iterative"] == free["iterative"]  # one token per run: its calibrated loop already
    assert charged["speculative"] < free["speculative"] and charged["pipeinfer"] < free["pipeinfer"]


def test_an_expensive_draft_gets_a_rank_of_its_own():
    # Four hosts, a draft as slow as 60 layers: drafting serially on the head holds up every run.
    best = best_placement(hosts(4, draft_token_s=60e-3), 4)
    assert best.placement.what == "draft on rank 3 of its own" and best.placement.layer_split().endswith("/1")
    assert best.placement.profile.draft.rank == 3
    assert any(p.what == "draft on the head" for p, _ in best.others)


def test_on_two_hosts_the_draft_stays_on_the_head():
    # A rank of its own would leave one host for all 28 layers.
    best = best_placement(hosts(2, draft_token_s=1e-3), 2)
    assert best.placement.topo.draft == "head" and not best.placement.layer_split().endswith("/1")
    assert [p.what for p, _ in best.others][-1] == "draft on rank 1 of its own"


def test_a_lighter_head_is_a_candidate_and_can_win():
    prof = hosts(4, draft_token_s=1e-3)
    cands = placements(prof, 4, [1] * 4, "model", JobMemory(), HeadLoad(draft_tokens=2.0))
    heads = [p.topo.layers[0][1] for p in cands if p.topo.draft == "head"]
    assert heads[0] == max(heads) and len(heads) >= 2  # the balanced head first, then lighter ones
    assert all(p.topo.layers[-1][1] == 28 for p in cands)
    best = search.search_placed(cands, "pipeinfer", REPLAY, DecodeOptions(), 4096)
    assert best.tok_per_s >= max(s for _, s in best.others if s is not None)


def test_a_draft_moved_to_another_rank_costs_what_that_rank_is_slower():
    prof = hosts(2, draft_token_s=1e-3)
    prof.ranks[1] = replace(rank_costs(1, per_layer=2e-3, per_row=4e-4), threads=1)  # twice as slow
    moved = draft_on(prof, prof, 1)
    assert moved.draft.rank == 1 and moved.draft.token_s == pytest.approx(2e-3)


def test_other_threads_are_extrapolated_or_taken_from_a_measured_profile():
    prof = hosts(2, threads=1, host="vm")
    two, guessed = at_threads(prof, [2, 2])
    assert guessed == [0, 1] and two.ranks[0].threads == 2
    assert two.ranks[0].decode.s[0][0] == pytest.approx(prof.ranks[0].decode.s[0][0] / 2 ** THREAD_SCALING)
    assert two.ranks[0].run_overhead_s == prof.ranks[0].run_overhead_s  # Python: one thread whatever the count
    measured = hosts(2, threads=2, host="vm")
    measured.ranks = [replace(rc, decode=replace(rc.decode, s=[[v / 1.5 for v in row] for row in rc.decode.s]))
                      for rc in measured.ranks]
    taken, guessed = at_threads(prof, [2, 2], {2: measured})
    assert guessed == [] and taken.ranks[0].decode.s == measured.ranks[0].decode.s


def test_auto_considers_the_threads_the_job_would_run_with():
    """A 1-thread profile of 2 ranks on one 2-CPU box: iterative runs with both CPUs per rank by
    default, which -M auto must weigh against the drafting modes at 1 thread (they compute at once)."""
    from pipeinfer_cli.planner.job_placement import thread_options

    prof = hosts(2, threads=1, host="vm", draft_token_s=3e-3)
    cfg = SimpleNamespace(threads=None)
    assert thread_options(prof, cfg, 2, "iterative") == [[1, 1], [2, 2]]
    assert thread_options(prof, cfg, 2, "pipeinfer") == [[1, 1]]  # 2 x 2 threads on 2 CPUs: not modelled
    assert thread_options(prof, SimpleNamespace(threads="1"), 2, "iterative") == [[1, 1]]

    def places(mode: str):
        kind = "model" if mode != "iterative" else None
        return [p for t in thread_options(prof, cfg, 2, mode)
                for p in placements(prof, 2, t, kind, JobMemory(), HeadLoad())]

    poor = Replay([search.auto_request(None, 32)], 0.3)
    c = search.choose(prof, None, ["iterative", "speculative", "pipeinfer"], poor, DecodeOptions(), 4096,
                      placements_of=places)
    assert c.mode == "iterative" and c.placement.threads == [2, 2]
    at_one = search.search_settings(prof, Topology([0, 1], [(0, 14), (14, 28)]), "iterative", poor, DecodeOptions(),
                                    4096)
    assert c.tok_per_s > at_one.tok_per_s


def test_several_requests_at_once_keep_their_own_split():
    """serve --parallel N balances the stages for the aggregate (planner/split.py): auto does not
    place the job for one request's speed there."""
    from pipeinfer_cli.planner.job_placement import split_is_chosen

    job = SimpleNamespace(layer_split="auto", parallel=1)
    assert split_is_chosen(job, 2) and not split_is_chosen(job, 1)
    assert not split_is_chosen(SimpleNamespace(layer_split="auto", parallel=2), 2)
    assert not split_is_chosen(SimpleNamespace(layer_split="2,1", parallel=1), 2)
    assert split_is_chosen(SimpleNamespace(layer_split=None, parallel=1), 3)  # -M auto without a split


def test_a_job_runs_the_placement_chosen_and_prints_iteratives_text(smollm2_path, tmp_path):
    """generate --layer-split auto on 3 ranks with a draft as slow as 60 of its layers (a profile
    made for SmolLM2's header): the job runs the draft on a rank of its own, says so, and its
    text is iterative's."""
    import json
    import os
    import subprocess
    import sys

    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.planner.identity import model_sha256

    info = read_model_info(smollm2_path)
    prof = hosts(3, draft_token_s=60e-3)
    prof.model = replace(prof.model, n_layer=info.n_layer, layer_bytes=info.layer_bytes, n_embd=info.n_embd,
                         file_bytes=info.file_size, sha256=model_sha256(smollm2_path))
    prof.save(tmp_path / "p.json")

    def generate(*args):
        r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "-p", "1, 2, 3, 1, 2,",
                            "-n", "8", "--ranks", "3", "--json", *args], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ))
        assert r.returncode == 0, r.stderr
        return r, json.loads(r.stdout)

    placed, out = generate("--draft", str(smollm2_path), "-M", "pipeinfer", "--layer-split", "auto", "--profile",
                           str(tmp_path / "p.json"))
    assert "--layer-split auto placed the job: --layer-split " in placed.stderr, placed.stderr
    assert "/1 (draft on rank 2 of its own" in placed.stderr and out["layer_split"].endswith("/1")
    _, iterative = generate("-M", "iterative")
    assert out["text"] == iterative["text"]

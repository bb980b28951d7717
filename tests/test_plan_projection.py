"""The replayed draft rank (`ReplayDraftRank`) and the projection that uses it (planner/project.py,
benchmarks/project_paper.py: 7 target stages and a draft on an eighth node): its answers, what it
charges and when its replies arrive, checked against arithmetic that is known."""

from __future__ import annotations

import pytest

from planning import make_profile, prompt_trace
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.planner.predict import Topology, build_pipeline, make_drafter, predict
from pipeinfer_cli.planner.profile import DraftCosts, LinkCosts
from pipeinfer_cli.planner.project import ClusterSpec, ModelSpec, NodeSpec, cluster_profile
from pipeinfer_cli.planner.replay import ChainIndex, PromptTrace, SyntheticChains
from pipeinfer_cli.planner.sim_drafters import ReplayDrafter, ReplayDraftRank
from pipeinfer_cli.planner.layout import ranges_from_fractions

# The paper's setup, as benchmarks/project_paper.py states it: a 70B Q3_K_M target, a 1.1B Q4_K_M
# draft on its own node, 16-core nodes at 25 GB/s, Gigabit Ethernet.
LLAMA_70B = ModelSpec("llama-70b-q3_k_m", 80, 8192, 32000, 410_000_000, 215_000_000, 855e6)
NODE = NodeSpec(mem_bandwidth=25e9, flops=400e9, row_cost=0.10, cores=16, memory=64 << 30, run_overhead_s=5e-4)
PAPER = ClusterSpec(LLAMA_70B, NODE, 8, 117e6, 100e-6, draft_bytes=669_000_000, draft_on_rank=True)
LAYERS = ranges_from_fractions([0.1] + [0.15] * 6, 80)


def chained_trace() -> PromptTrace:
    """A trace whose draft is right twice, then wrong, from every committed prefix."""
    pt = prompt_trace(n_gen=12, n_prompt=6)
    full = pt.full
    pt.chains_from = len(pt.prompt) + 1
    for n in range(pt.chains_from, len(full)):
        right = full[n:n + 2]
        pt.chains.append(right + [999] * (4 - len(right)))
        pt.chain_probs.append([0.9, 0.8, 0.7, 0.6][:len(pt.chains[-1])])
    return pt


def test_a_draft_rank_answers_from_the_chains_over_its_links_without_charging_the_head():
    prof = make_profile(2)
    pt = chained_trace()
    pipe = build_pipeline(prof, Topology([0, 1], [(0, 10), (10, 20)], 1), pt, DecodeOptions(), 4096)
    costs = DraftCosts("model", "test-draft", 1, 1, token_s=1e-3, prompt_token_s=2e-3)
    to_rank, to_head = LinkCosts(0, 1, 1e-4, 1e6), LinkCosts(1, 0, 2e-4, 1e6)
    rank = ReplayDraftRank(pipe, ChainIndex(pt), costs, to_rank, to_head)
    rank.start(pt.prompt)  # the prompt crosses the link, then the rank reads it
    prompt_read = to_rank.seconds(8 * len(pt.prompt)) + len(pt.prompt) * 2e-3
    path = pt.full[:pt.chains_from]
    rank.request(path, 3, 0.0)
    assert pipe.t == 0.0 and rank.outstanding and not rank.ready()  # the head goes on meanwhile
    # The rank is still reading the prompt when the request arrives; it streams after that, and the
    # reply leaves with the first token: one eval later (the token after the prompt).
    assert to_rank.seconds(8 * len(path)) < prompt_read
    assert rank.reply_at == pytest.approx(prompt_read + 1e-3 + to_head.seconds(12))
    pipe.t = rank.reply_at / 2
    assert rank.poll() is None
    prop = rank.wait()
    assert pipe.t == pytest.approx(rank.reply_at) and not rank.outstanding
    assert prop.tokens == pt.chains[0][:1] and prop.probs == [0.9] and prop.base == path
    assert rank.wait() is None  # nothing outstanding: nothing to wait for
    # The rank drafted on: a request that continues the path with the token just launched is answered
    # from the stream (no new eval), once its next token is drafted, one eval later.
    evals = rank.model.evals
    rank.request(path + prop.tokens, 3, 0.0)
    assert rank.model.evals == evals
    assert rank.reply_at == pytest.approx(prompt_read + 2e-3 + to_head.seconds(12))
    assert rank.wait().tokens == [pt.chains[0][1]]
    # A head that comes back later gets every token drafted by then in one reply.
    pipe.t = prompt_read + 10e-3
    rank.request(path + pt.chains[0][:2], 3, 0.0)
    assert rank.wait().tokens == pt.chains[0][2:4] and rank.model.evals == evals
    # The draft was wrong at its third token: the path the target took opens a new stream.
    truth = pt.full[:pt.chains_from + 3]
    rank.request(truth, 2, 0.0)
    assert rank.model.evals > evals and rank.wait().tokens == pt.chains[3][:1]


def test_the_projection_puts_the_draft_on_its_own_node_and_replays_it_there():
    prof = cluster_profile(PAPER)
    assert prof.draft.kind == "model" and prof.draft.rank == 7
    assert prof.draft.token_s == pytest.approx(669_000_000 / 25e9)
    pt = prompt_trace(n_gen=48, n_prompt=64)
    topo = Topology(list(range(7)), LAYERS, 7)
    drafter = make_drafter(prof, topo, build_pipeline(prof, topo, pt, DecodeOptions(), 4096), ChainIndex(pt))
    assert isinstance(drafter, ReplayDraftRank)
    assert (drafter.to_rank.src, drafter.to_rank.dst, drafter.to_head.src, drafter.to_head.dst) == (0, 7, 7, 0)
    head = make_drafter(prof, Topology(list(range(7)), LAYERS, "head"),
                        build_pipeline(prof, topo, pt, DecodeOptions(), 4096), ChainIndex(pt))
    assert isinstance(head, ReplayDrafter)


def projected(mode: str, draft, acceptance: float = 0.8, seed: int = 0):
    pt = prompt_trace(n_gen=48, n_prompt=64)
    return predict(cluster_profile(PAPER), Topology(list(range(7)), LAYERS, draft), mode, pt,
                   DecodeOptions(n_draft=4, p_accept=0.5, max_inflight=4), SyntheticChains(pt, acceptance, 24, seed))


def test_a_draft_rank_drafts_what_the_head_would_and_pipeinfer_gains_from_it():
    """Speculative decoding asks the same paths wherever the draft runs: the same acceptance, and on
    its own node each proposal also crosses the links both ways (slower). pipeinfer keeps drafting
    off the head's time there (faster), and on the paper's setup beats both baselines."""
    it = projected("iterative", None)
    sp_rank, sp_head = projected("speculative", 7), projected("speculative", "head")
    pi_rank, pi_head = projected("pipeinfer", 7), projected("pipeinfer", "head")
    assert sp_rank.acceptance == sp_head.acceptance and sp_rank.acceptance["drafted"] > 0
    assert sp_rank.tok_per_s < sp_head.tok_per_s
    assert pi_rank.acceptance["drafted"] > 0 and pi_rank.draft_misses == 0
    # Over several draws of which drafted tokens are right (one draw may favour either placement
    # by a few per cent): the draft rank is faster.
    seeds = range(8)
    assert sum(projected("pipeinfer", 7, seed=s).tok_per_s for s in seeds) > \
        sum(projected("pipeinfer", "head", seed=s).tok_per_s for s in seeds)
    assert pi_rank.tok_per_s > sp_rank.tok_per_s > it.tok_per_s
    assert all(p.n_gen == 48 for p in (it, sp_rank, pi_rank))
    assert projected("pipeinfer", 7).to_json() == pi_rank.to_json()  # deterministic


def test_a_draft_rank_replays_a_recorded_chain_as_the_head_would():
    """Recorded chains (not a synthetic rate) through the draft rank: the proposals stop being
    right at each chain's wrong token, as they do with the draft on the head."""
    prof = make_profile(2, draft_token_s=1e-3)
    pt = chained_trace()
    acc = {}
    for where in (1, "head"):
        prof.draft = DraftCosts("model", "test-draft", 1 if where == 1 else 0, 1, 1e-3, 0.0)
        r = predict(prof, Topology([0, 1], [(0, 10), (10, 20)], where), "speculative", pt, DecodeOptions(n_draft=3),
                    ChainIndex(pt))
        assert r.n_gen == len(pt.tokens) and r.draft_misses == 0
        acc[where] = r.acceptance
    assert acc[1] == acc["head"]
    assert 0 < acc[1]["accepted"] < acc[1]["drafted"]  # each chain's third token is wrong

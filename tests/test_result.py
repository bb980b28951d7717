"""GenerationResult.to_json is the public JSON of `generate --json`: its keys, their order, and the
optional fields that appear only when set."""

from __future__ import annotations

import json

from pipeinfer_cli.decode.cpu_account import CpuSplit
from pipeinfer_cli.decode.metrics import Acceptance, DraftWork, GenerationMetrics, ProcessStats, RunCounters
from pipeinfer_cli.decode.result import GenerationResult, RankReport

KEYS = ["prompt_id", "mode", "model", "draft", "layer_split", "n_ctx", "text", "tokens", "finish_reason",
        "n_prompt", "n_gen", "ttft_s", "tok_per_s", "decode_tok_per_s", "itl_ms", "acceptance", "runs", "wire",
        "t_start", "t_end", "ranks", "reused_tokens", "common_prefix_tokens", "draft_vocab", "drafting"]


RANK_KEYS = ["rank", "role", "layers", "threads", "peak_rss_mib", "busy_s", "cpu_s", "runs", "wait", "process"]


def _rank(rank: int = 0, **kw) -> RankReport:
    return RankReport(rank, "head", [0, 10], 1, 50.0, 0.5, 0.6, 3, "spin", ProcessStats(50.0, 9, 2, 1), **kw)


def _result(**kw) -> GenerationResult:
    m = GenerationMetrics(n_prompt=2, t_start=1.0, token_times=[1.5, 2.0, 2.0, 2.5],
                          acceptance=Acceptance(drafted=4, accepted=3, verified_runs=2), runs=RunCounters(launched=3))
    base = dict(prompt_id="p", mode="speculative", model="t", draft="d", layer_split="10,10", n_ctx=64, text="abcd",
                tokens=[1, 2, 3, 4], finish_reason="length", **vars(m.rates()), acceptance=m.acceptance, runs=m.runs,
                wire={"links": []}, t_start=1.0, t_end=3.0,
                ranks=[_rank(trace=[("i", "commit", 1.5, 1.5, {})], clock_offset_s=0.0)])
    return GenerationResult(**{**base, **kw})


def test_to_json_keeps_the_metrics_dict_and_the_key_order():
    r = _result()
    d = r.to_json()
    assert list(d) == KEYS
    m = GenerationMetrics(n_prompt=2, t_start=1.0, token_times=[1.5, 2.0, 2.0, 2.5],
                          acceptance=Acceptance(drafted=4, accepted=3, verified_runs=2), runs=RunCounters(launched=3))
    assert {k: d[k] for k in m.to_dict()} == m.to_dict()
    assert d["acceptance"] == {"drafted": 4, "accepted": 3, "rate": 0.75, "mean_accepted_len": 1.5}
    assert list(d["ranks"][0]) == RANK_KEYS + ["clock_offset_s"]  # no trace events
    assert d["ranks"][0]["layers"] == [0, 10] and d["ranks"][0]["clock_offset_s"] == 0.0
    assert "trace" in r.to_json(trace=True)["ranks"][0] and r.ranks[0].trace  # to_json does not mutate
    json.dumps(d)


def test_hybrid_acceptance_is_counted_per_source():
    acc = Acceptance()
    acc.add(4, 3, "lookup")
    acc.add(2, 1, "model")
    acc.add(1, 1)  # a drafter that names no source counts in the totals only
    d = _result(acceptance=acc, draft_vocab="translated").to_json()
    assert d["draft_vocab"] == "translated"
    assert d["acceptance"]["drafted"] == 7 and d["acceptance"]["accepted"] == 5
    assert d["acceptance"]["by_source"] == {"lookup": {"drafted": 4, "accepted": 3, "rate": 0.75},
                                            "model": {"drafted": 2, "accepted": 1, "rate": 0.5}}


def test_optional_fields_appear_only_when_set():
    d = _result(debug_diverged=True, queue_s=None, request_seq=4, run_index=2).to_json()
    assert list(d)[len(KEYS):] == ["debug_diverged", "queue_s", "request_seq", "run_index", "slot"]
    assert d["queue_s"] is None and d["request_seq"] == 4
    assert _result().kv_used_cells() == {} and _result(ranks=[_rank(1, engine={}, kv_used_cells=7)]).kv_used_cells() == {"1": 7}


def test_rank_report_keys_keep_their_order():
    """A stage's report with an engine, a link and its extra count: the keys of the JSON before
    RankReport was a dataclass, in their order; absent parts are left out."""
    r = _rank(1, weights={"source": "sent"}, engine={"evals": 3}, kv_used_cells=9, kv_used_cells_at_start=None,
              kv_min_resume=0, wire={"sent": {}}, skipped_before_start=2, trace=[], clock_offset_s=0.5)
    assert list(r.as_dict()) == RANK_KEYS + ["weights", "engine", "kv_used_cells", "kv_used_cells_at_start",
                                             "kv_min_resume", "wire", "skipped_before_start", "clock_offset_s"]
    assert list(r.as_dict(trace=True))[-2:] == ["trace", "clock_offset_s"]
    assert list(_rank(rows_requested=4).as_dict()) == RANK_KEYS + ["rows_requested"]
    assert "trace" not in _rank(trace=None).as_dict(trace=True)  # dropped (a server keeps none)


def test_drafting_counts_tokens_per_committed_token():
    d = _result(drafting=DraftWork(proposed=6, launched=5)).to_json()
    assert d["drafting"] == {"proposed": 6, "launched": 5, "proposed_per_committed": 1.5, "launched_per_committed": 1.25}
    assert _result(tokens=[], n_gen=0).to_json()["drafting"]["proposed_per_committed"] is None


def test_a_rank_report_carries_its_cpu_split_last():
    split = CpuSplit(stage_s=0.25, draft_s=0.125, own_s=0.0625, own_wait_s=0.03125)
    d = _rank(cpu_split=split, clock_offset_s=0.0).as_dict()
    assert list(d) == RANK_KEYS + ["clock_offset_s", "cpu_split"]
    assert d["cpu_split"] == {"stage_s": 0.25, "draft_s": 0.125, "own_s": 0.0625, "own_wait_s": 0.0312}
    assert split.total_s == 0.4375 and split.own_share == 0.0625 / 0.4375
    assert "cpu_split" not in _rank().as_dict()

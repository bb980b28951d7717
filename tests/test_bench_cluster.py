"""scripts/bench_cluster.py's bookkeeping (the campaign itself needs root and a quiet machine:
`make bench-cluster`): configurations, the text check that fails a run, the speedups."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_cluster as bc  # noqa: E402


def test_configs_parse_and_bad_ones_name_the_fix():
    assert bc.parse_config("iterative") == {"label": "iterative", "mode": "iterative", "draft": None, "placement": None}
    own = bc.parse_config("pipeinfer:smollm2-135m-instruct@own")
    assert (own["mode"], own["draft"], own["placement"]) == ("pipeinfer", "smollm2-135m-instruct", "own")
    assert bc.parse_config("speculative:lookup+qwen")["placement"] == "head"
    assert bc.parse_config("pipeinfer:smollm2-135m-instruct@shared")["placement"] == "shared"
    for bad, says in (("greedy", "the mode must be"), ("pipeinfer", "needs a draft"), ("pipeinfer:x@moon", "placement"),
                      ("pipeinfer:lookup@own", "only a draft model"), ("pipeinfer:lookup+x@shared", "only a draft model")):
        with pytest.raises(bc.Failure, match=says):
            bc.parse_config(bad)


def _row(label, hosts, tokens, tok_s, rate="1gbit"):
    cfg = bc.parse_config(label)
    return {**cfg, "hosts": hosts, "rate": rate, "tok_per_s": tok_s,
            "records": [{"prompt_id": "p", "tokens": tokens}]}


def test_a_text_that_differs_anywhere_is_reported_against_the_reference():
    rows = [_row("iterative", 1, [1, 2, 3], 2.0), _row("iterative", 4, [1, 2, 3], 2.5),
            _row("pipeinfer:lookup", 4, [1, 2, 4], 3.0)]
    bad = bc.check_texts(rows)
    assert bad == ["pipeinfer:lookup on 4 hosts at 1gbit: prompt p differs from iterative on 1 hosts at token 2"]
    assert [r["texts_identical"] for r in rows] == [True, True, False]
    assert bc.check_texts(rows[:2]) == []


def test_speedups_are_against_iterative_and_the_best_speculative_of_the_same_hosts():
    rows = [_row("iterative", 4, [1], 2.0), _row("speculative:lookup", 4, [1], 1.0),
            _row("pipeinfer:lookup", 4, [1], 3.0), _row("iterative", 8, [1], 1.0)]
    bc.speedups(rows)
    assert rows[2]["x_iterative"] == 1.5 and rows[2]["x_speculative"] == 3.0
    assert rows[3]["x_iterative"] == 1.0 and rows[3]["x_speculative"] is None


def test_a_draft_rank_takes_a_host_of_its_own_or_shares_the_head_s(monkeypatch):
    monkeypatch.setattr(bc, "balanced_fractions", lambda model, n: ",".join(["f"] * n))
    a = type("A", (), {"model": "m", "pipeinfer": "pipeinfer", "n_predict": 8, "prompts": "default", "limit": 1,
                       "bench_arg": []})()

    def ranks_and_split(label, hosts):
        cmd = bc.bench_cmd(a, hosts, bc.parse_config(label), Path("out.json"))
        split = cmd[cmd.index("--layer-split") + 1] if "--layer-split" in cmd else None
        return cmd[cmd.index("--ranks") + 1], split

    assert ranks_and_split("pipeinfer:d", 4) == ("4", None)
    assert ranks_and_split("pipeinfer:d@own", 4) == ("4", "f,f,f/1")  # 3 stages + the draft's host
    assert ranks_and_split("pipeinfer:d@shared", 4) == ("5", "f,f,f,f/1")  # rank 4 wraps onto host 0

"""The scaling benchmark (benchmarks/scaling.py, `make bench-cluster`): configurations, the text
check, the speedups; then whole campaigns on a fake cluster with a fake `pipeinfer` (the real one
needs root and a quiet machine): a row whose job fails and a text that differs from iterative's
each make the run exit 1 naming the row, every row is run --repeat times and reported as median
(min–max), the table names the machine's CPU, and an extra column is read from the job's JSON."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import pytest

import benchmarks.scaling as bc
from benchmarks.report import machine


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


# -- whole campaigns on a fake cluster -------------------------------------------------------------

# A stand-in for `pipeinfer bench`: writes one record per prompt with the tokens of iterative, but
# a draft named `broken` fails as a job does (one Error line, exit 1, no JSON) and a draft named
# `differ` changes the third token.
FAKE_PIPEINFER = r"""#!{python}
import json, sys
a = sys.argv[1:]
arg = lambda k, d=None: a[a.index(k) + 1] if k in a else d
draft = arg("--draft", "")
if a[0] == "generate":  # an auto row: one prompt, its JSON on stdout, the job's choice in "auto"
    given = json.load(open(arg("--messages")))[0]["content"] if "--messages" in a else arg("-p")
    if given not in ("raw text", "a chat message") or arg("-M") != "auto" or arg("--layer-split") != "auto":
        print(f"Error: unexpected prompt or options: {{a}}", file=sys.stderr)
        sys.exit(1)
    json.dump({{"prompt_id": "", "mode": "pipeinfer", "tokens": [1, 2, 3], "n_gen": 3, "tok_per_s": 4.0,
               "decode_tok_per_s": 5.0, "ttft_s": 0.4, "acceptance": {{"drafted": 4, "accepted": 4}},
               "ranks": [{{"rank": 0, "cpu_s": 1.0}}], "auto": {{"mode": "pipeinfer", "layer_split": "1,27"}}}}, sys.stdout)
    sys.exit(0)
if draft == "broken":
    print("Error: the draft model could not be loaded", file=sys.stderr)
    sys.exit(1)
tokens = [1, 2, 9 if draft == "differ" else 3]
records = [{{"prompt_id": f"p{{i}}", "mode": arg("--modes"), "tokens": tokens, "n_gen": 3, "tok_per_s": 2.0 + i,
            "decode_tok_per_s": 3.0, "ttft_s": 0.5, "acceptance": {{"drafted": 4, "accepted": 3}} if draft else None,
            "ranks": [{{"rank": 0, "cpu_s": 1.5}}, {{"rank": 1, "cpu_s": 0.5}}]}}
           for i in range(int(arg("--limit", "1")))]
json.dump({{"records": records}}, open(arg("--json"), "w"))
"""


class FakeCluster:
    cpus = [1.0]
    wrapper = Path("/nonexistent")

    def __init__(self):
        self.t = 0.0

    def usage(self):
        self.t += 1.0
        return {"pi-h0": {"cpu_s": self.t, "throttled_s": 0.0, "mem_peak": 0, "oom_kills": 0}}

    def env(self):
        return {}

    def memory_failures(self, before):
        return []

    def host(self, k):
        return f"pi-h{k}"


@pytest.fixture
def campaign(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "pipeinfer"
    fake.write_text(FAKE_PIPEINFER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(bc, "require_root", lambda: None)
    monkeypatch.setattr(bc, "emulated_cluster", lambda *a, **k: contextlib.nullcontext(FakeCluster()))

    def run(*args):
        out = tmp_path / "cluster.json"
        status = bc.main(["--pipeinfer", str(fake), "--hosts", "2", "--limit", "2", "--work-dir", str(tmp_path / "w"),
                          "--json", str(out), "--markdown", str(tmp_path / "cluster.md"), *args])
        captured = capsys.readouterr()
        return status, json.loads(out.read_text()), (tmp_path / "cluster.md").read_text(), captured.err
    return run


def test_a_row_that_fails_to_run_fails_the_campaign_and_is_named(campaign):
    status, doc, md, err = campaign("--configs", "iterative,pipeinfer:broken", "--repeat", "2")
    assert status == 1
    assert "Error: a row failed to run: pipeinfer:broken on 2 hosts at 1gbit: 2 of 2 runs failed: " \
           "Error: the draft model could not be loaded" in err
    broken = next(r for r in doc["rows"] if r["label"] == "pipeinfer:broken")
    assert broken["texts_identical"] is None and len(broken["failed_runs"]) == 2
    line = next(x for x in md.splitlines() if "pipeinfer:broken" in x)
    assert "FAILED (2/2 runs)" in line and "same" not in line


def test_a_text_that_differs_from_iterative_fails_the_campaign(campaign):
    status, doc, md, err = campaign("--configs", "iterative,pipeinfer:differ", "--repeat", "1")
    assert status == 1
    assert "Error: texts differ: pipeinfer:differ on 2 hosts at 1gbit: prompt p0 differs from iterative on 2 hosts " \
           "at token 2" in err
    assert "DIFFER" in next(x for x in md.splitlines() if "pipeinfer:differ" in x)


def test_rows_are_repeated_and_reported_as_median_with_spread_on_a_named_cpu(campaign, monkeypatch):
    monkeypatch.setattr(bc, "JOB_COLUMNS", [])  # only the --column ones below
    status, doc, md, err = campaign("--configs", "iterative,pipeinfer:lookup", "--repeat", "3",
                                    "--column", "CPU s all ranks=ranks.*.cpu_s", "--column", "head CPU s=ranks.0.cpu_s")
    assert status == 0, err
    cpu = machine()["cpu_model"]
    assert doc["machine"]["cpu_model"] == cpu and md.startswith(f"Machine: {cpu},")
    it = next(r for r in doc["rows"] if r["label"] == "iterative")
    assert len(it["runs"]) == 3 and it["tok_per_s_spread"] == {"median": 2.5, "min": 2.5, "max": 2.5, "n": 3}
    assert it["host_cpu_s_max"]["n"] == 3 and it["texts_identical"] is True
    assert it["columns"] == {"CPU s all ranks": {"median": 2.0, "min": 2.0, "max": 2.0, "n": 3},
                             "head CPU s": {"median": 1.5, "min": 1.5, "max": 1.5, "n": 3}}
    head = md.splitlines()[2]
    assert "| runs |" in head and "| CPU s all ranks | head CPU s | texts |" in head
    assert re.search(r"\| `iterative` \| – \| 3 \| 2\.50 \|", md)


def test_spread_is_shown_as_median_min_max():
    from benchmarks.figures import spread
    from benchmarks.report import fmt_spread

    assert fmt_spread(spread([2.0, 1.0, 4.0])) == "2.00 (1.00–4.00)"
    assert fmt_spread(spread([3.0])) == "3.00" and fmt_spread(None) == "–"


def test_columns_read_paths_into_the_job_s_records():
    rec = {"ranks": [{"cpu_s": 1.0, "role": "head"}, {"cpu_s": 2.5}], "ttft_s": 0.2}
    assert bc.parse_column("x=ranks.*.cpu_s").of(rec) == 3.5
    assert bc.parse_column("x=ranks.1.cpu_s").of(rec) == 2.5 and bc.parse_column("x=ttft_s").of(rec) == 0.2
    assert bc.parse_column("x=ranks.5.cpu_s").of(rec) is None and bc.parse_column("x=ranks.0.role").of(rec) is None
    with pytest.raises(bc.Failure, match="give LABEL=PATH"):
        bc.parse_column("ranks.0.cpu_s")


def test_the_makefile_pipes_no_benchmark_into_tee():
    """`cmd | tee` without pipefail exits with tee's status: a failed benchmark would pass."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    bad = [line.strip() for line in makefile.splitlines() if line.startswith("\t") and "| tee" in line]
    assert not bad, bad


def test_a_column_declared_in_the_code_is_in_every_table(campaign, monkeypatch):
    """What another field of the job's JSON takes: one RecordColumn appended to JOB_COLUMNS."""
    monkeypatch.setattr(bc, "JOB_COLUMNS", [bc.RecordColumn("rank 1 CPU s", "ranks.1.cpu_s")])
    status, doc, md, err = campaign("--configs", "iterative", "--repeat", "1")
    assert status == 0, err
    assert "| rank 1 CPU s | texts |" in md.splitlines()[2]
    assert doc["rows"][0]["columns"]["rank 1 CPU s"]["median"] == 0.5


def test_an_auto_row_runs_generate_for_each_prompt_and_keeps_its_choice(campaign, tmp_path):
    """`auto:DRAFT`: what `generate -M auto --layer-split auto` chooses with no profile, one job per
    prompt (raw or chat), its records checked against iterative's like any row's."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "p0", "prompt": "raw text"}\n'
                       '{"id": "p1", "messages": [{"role": "user", "content": "a chat message"}]}\n')
    status, doc, md, err = campaign("--configs", "iterative,auto:d", "--repeat", "2", "--prompts", str(prompts))
    assert status == 0, err
    auto = next(r for r in doc["rows"] if r["label"] == "auto:d")
    assert auto["placement"] == "auto" and auto["texts_identical"] is True and auto["x_iterative"] == 4.0 / 2.5
    assert [rec["prompt_id"] for rec in auto["runs"][0]["records"]] == ["p0", "p1"]
    assert auto["runs"][1]["records"][1]["auto"] == {"mode": "pipeinfer", "layer_split": "1,27"}
    assert "generate" in auto["command"] and "-M auto --layer-split auto" in auto["command"]
    line = next(x for x in md.splitlines() if "`auto:d`" in x)
    assert "| auto |" in line and "same" in line
    with pytest.raises(bc.Failure, match="chooses the placement itself"):
        bc.parse_config("auto:d@own")

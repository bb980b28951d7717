"""`pipeinfer bench --concurrency`: the levels and options (no server), the statistics on fixed
numbers, the text check, the serve command line bench builds, and real runs against a served
SmolLM2 (1 rank, and 2 ranks) that write the JSON. No test asserts on how long anything took."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from typer.testing import CliRunner

from jobprocs import assert_no_survivors, job_env
from pipeinfer_cli.bench import concurrency as cc
from pipeinfer_cli.cli import bench_cmd, bench_serve
from pipeinfer_cli.cli.app import app
from pipeinfer_cli.cli.job_options import JobOptions
from pipeinfer_cli.errors import UsageError

runner = CliRunner()
MODEL = "smollm2-135m-instruct"


# -- levels and options -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, levels", [
    ("1,2,4,8", [1, 2, 4, 8]), ("4, 2", [1, 2, 4]), ("1", [1]), ("3", [1, 3]), ("8,1", [1, 8]),
])
def test_levels_are_sorted_and_always_include_1(text, levels):
    assert cc.parse_levels(text) == levels


@pytest.mark.parametrize("text, message", [
    ("0", "level 0 is not allowed"), ("-2", "level -2 is not allowed"), ("abc", "'abc' is not an integer"),
    ("1.5", "'1.5' is not an integer"), ("1,,2", "empty item"), ("", "--concurrency is empty"), (" , ", "is empty"),
    ("2,2", "lists 2 more than once"), ("20000", "above 10000"),
])
def test_bad_levels(text, message):
    with pytest.raises(UsageError, match=message):
        cc.parse_levels(text)


@pytest.fixture
def no_models(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("bench resolved a model before rejecting bad input")

    monkeypatch.setattr(bench_cmd, "prepare_job", forbidden)  # the set-up that resolves (and pulls) the models


def _one_error_line(r) -> str:
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "--concurrency level 0"),
    (["--concurrency", "two"], "'two' is not an integer"),
    (["--concurrency", "1,2", "--parallel", "0"], "--parallel"),
    (["--parallel", "2"], "give --concurrency too"),
    (["--load-policy", "yield"], "give --concurrency too"),
    (["--concurrency", "1,2", "--load-policy", "greedy"], "--load-policy 'greedy' is not one of yield"),
    (["--concurrency", "1,2", "--csv", "x.csv"], "--csv cannot be written with --concurrency"),
    (["--concurrency", "1,2", "--plot", "x.png", "--trace", "t.json"], "--trace, --plot cannot be written"),
])
def test_bad_input_is_one_error_line(no_models, args, message):
    assert message in _one_error_line(runner.invoke(app, ["bench", MODEL, *args]))


def test_help_explains_concurrency_with_an_example():
    r = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "--concurrency" in r.output and "--parallel" in r.output
    assert "--concurrency 1,2,4" in r.output  # the example


def test_serve_gets_the_job_options_bench_was_given():
    job = JobOptions(draft="lookup", n_predict=-1, temp=0.7, seed=3, ranks=2, threads="1,1", ctx=1024, no_pull=True,
                     max_inflight=4)
    args = bench_serve.serve_args("m", job, needs_draft=True, parallel=1, queue=8)
    assert args == ["m", "--draft=lookup", "--n-predict=-1", "--temp=0.7", "--seed=3", "--ranks=2", "--threads=1,1",
                    "--ctx=1024", "--no-pull", "--queue=8"]
    # no draft when no mode needs one; --parallel forwarded as given when not 1
    args = bench_serve.serve_args("m", job, needs_draft=False, parallel=4, queue=4, load_policy="no-spec")
    assert "--draft=lookup" not in args and args[-2:] == ["--parallel=4", "--load-policy=no-spec"]
    # every option name it forwards is one serve has
    names = {o for p in bench_serve.serve_params().values() for o in p.opts}
    assert all(a.split("=")[0] in names for a in args[1:])


# -- statistics on fixed numbers --------------------------------------------------------------------
def test_percentile_is_linear_between_ranks():
    xs = [40.0, 10.0, 30.0, 20.0]
    assert cc.percentile(xs, 50) == 25.0
    assert cc.percentile(xs, 0) == 10.0 and cc.percentile(xs, 100) == 40.0
    assert cc.percentile(xs, 99) == pytest.approx(39.7)
    assert cc.percentile([5.0], 99) == 5.0
    assert cc.percentile([], 50) is None
    with pytest.raises(ValueError):
        cc.percentile(xs, 101)


def test_decode_rate():
    assert cc.decode_tok_per_s(5, 1.0, 3.0) == 2.0
    assert cc.decode_tok_per_s(1, 1.0, 3.0) is None
    assert cc.decode_tok_per_s(5, 2.0, 2.0) is None  # every token in one chunk


def _rec(pid, text, level=1, mode="iterative", tokens=None, n=4, ttft=0.1, itl=(10.0, 20.0, 30.0), dec=50.0,
         warmup=False, error=None):
    return {"mode": mode, "concurrency": level, "prompt_id": pid, "repeat": 0, "warmup": warmup, "text": text,
            "tokens": tokens, "completion_tokens": None if error else n, "ttft_s": None if error else ttft,
            "itl_ms": [] if error else list(itl), "decode_tok_per_s": None if error else dec, "error": error}


def test_aggregate_on_fixed_numbers():
    recs = [_rec("a", "x", n=10, ttft=0.1, itl=(10.0, 20.0), dec=40.0),
            _rec("b", "y", n=30, ttft=0.3, itl=(30.0, 40.0), dec=60.0),
            _rec("c", "", error="APIError: boom")]
    s = cc.aggregate(recs, wall_s=2.0)
    assert s["n_requests"] == 3 and s["n_errors"] == 1
    assert s["completion_tokens"] == 40
    assert s["tok_per_s"] == 20.0 and s["requests_per_s"] == 1.0  # failed requests do not count as served
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert s["itl_ms"]["p50"] == 25.0 and s["itl_ms"]["p99"] == pytest.approx(39.7)  # pooled over requests
    assert s["decode_tok_per_s_mean"] == 50.0
    assert cc.aggregate([], 0.0)["tok_per_s"] is None


def test_identity_check_and_summary():
    recs = [_rec("a", "hello", warmup=True, tokens=[1, 2]),
            _rec("a", "hello", tokens=[1, 2]), _rec("b", "world", tokens=[3]),
            _rec("a", "hello", level=2, tokens=[1, 2]), _rec("b", "wordl", level=2, tokens=[3]),
            _rec("a", "hello", level=4, tokens=[1, 9]), _rec("b", "world", level=4)]
    mismatches = cc.check_identical(recs)
    assert [r["identical_to_level_1"] for r in recs] == [True, True, True, True, False, False, True]
    assert [(m["concurrency"], m["prompt_id"], m["first_diff_char"], m["tokens_identical"]) for m in mismatches] == [
        (2, "b", 3, True), (4, "a", None, False)]
    assert "concurrency 2" in cc.describe_mismatch(mismatches[0]) and "'dl'" in cc.describe_mismatch(mismatches[0])
    walls = {("iterative", 1): 2.0, ("iterative", 2): 1.0, ("iterative", 4): 0.5}
    rows = cc.summarize(recs, ["iterative"], [1, 2, 4], walls, {("iterative", 1): 1, ("iterative", 2): 2})
    assert [(r["concurrency"], r["n_requests"], r["identical_to_level_1"], r["mismatched_prompts"]) for r in rows] == [
        (1, 2, True, []), (2, 2, False, ["b"]), (4, 2, False, ["a"])]  # the warmup is not counted
    assert [r["tok_per_s"] for r in rows] == [4.0, 8.0, 16.0]
    assert [r["tok_per_s_vs_level_1"] for r in rows] == [1.0, 2.0, 4.0]
    doc = cc.document({}, rows, mismatches, recs)
    assert doc["schema"] == cc.SCHEMA and doc["identical_to_level_1"] is False


# -- real runs: a served SmolLM2, 2 prompts, 8 tokens -----------------------------------------------
def _run_bench(out, model_path, *extra) -> subprocess.CompletedProcess:
    """`bench --concurrency` on a cache of its own holding the model: its server (--parallel 2 on
    several ranks, no split) calibrates, and keeps the profile there, not in the user's cache."""
    marker = uuid.uuid4().hex
    cache = out / "cache"
    cache.mkdir()
    (cache / model_path.name).symlink_to(model_path)
    cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", MODEL, "--modes", "iterative", "--concurrency", "1,2",
           "--limit", "2", "-n", "8", "--json", str(out / "load.json"), *extra]
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=out,
                              env=job_env(marker, PIPEINFER_NO_PULL="1", PIPEINFER_CACHE=str(cache)),
                              start_new_session=True)
    finally:
        assert_no_survivors(marker)  # the server and its ranks are gone


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_real_load_writes_the_json(smollm2_path, tmp_path, ranks):
    r = _run_bench(tmp_path, smollm2_path, "--ranks", str(ranks), "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "Error" not in r.stderr and "server ready" in r.stderr
    assert "concurrency" in r.stdout and "reference" in r.stdout and "same" in r.stdout
    doc = json.loads((tmp_path / "load.json").read_text())
    assert doc["schema"] == "pipeinfer-bench-concurrency/1"
    assert doc["identical_to_level_1"] is True and doc["mismatches"] == []
    h = doc["header"]
    assert h["config"]["concurrency"] == [1, 2] and h["config"]["ranks"] == ranks
    assert h["config"]["parallel"] == 2 and h["config"]["load_policy"] == "yield"
    assert h["server"]["command"].startswith("pipeinfer serve ") and f"{ranks} rank" in " ".join(h["server"]["banner"])
    assert h["server"]["exit_status"] == 0
    assert len(h["models"]["target"]["sha256"]) == 64
    assert [(s["mode"], s["concurrency"]) for s in doc["summary"]] == [("iterative", 1), ("iterative", 2)]
    for s in doc["summary"]:
        assert s["n_requests"] == 2 and s["n_errors"] == 0 and s["identical_to_level_1"] is True
        assert s["completion_tokens"] > 0 and s["tok_per_s"] > 0 and s["requests_per_s"] > 0
        assert s["ttft_ms"]["p50"] is not None and s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"]
        assert s["itl_ms"]["p99"] >= s["itl_ms"]["p50"]
        assert s["peak_in_flight"] == s["concurrency"]
    recs = doc["records"]
    measured = [x for x in recs if not x["warmup"]]
    assert len(measured) == 4 and len(recs) == 5  # one warmup request
    for x in recs:
        assert x["error"] is None and x["text"]
        assert x["completion_tokens"] >= 1 and x["tokens_counted_by"] == "usage"
        assert len(x["tokens"]) == x["completion_tokens"]
        assert x["ttft_s"] > 0 and len(x["itl_ms"]) == x["n_chunks"] - 1
        assert x["identical_to_level_1"] is True
        assert x["server_timings"]["mode"] == "iterative"
    by_level = {lv: {x["prompt_id"]: x["tokens"] for x in measured if x["concurrency"] == lv} for lv in (1, 2)}
    assert by_level[1] == by_level[2] and len(by_level[1]) == 2

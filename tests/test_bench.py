"""`pipeinfer bench`: prompt sets, schedule, statistics, bad input before loading, and real MPI runs
that write JSON, CSV, a Chrome trace and a PNG, plus a forced divergence that must be reported."""

from __future__ import annotations

import csv
import json
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeinfer_cli.bench.prompts import PromptFileError, load_prompts, parse_prompts
from pipeinfer_cli.bench.runner import check_tokens
from pipeinfer_cli.bench.schedule import build_schedule
from pipeinfer_cli.bench.stats import summarize
from pipeinfer_cli.cli import bench_cmd
from pipeinfer_cli.cli.app import app

runner = CliRunner()
MODEL = "smollm2-135m-instruct"
METRICS = ("n_prompt", "n_gen", "ttft_s", "tok_per_s", "decode_tok_per_s", "itl_ms", "acceptance", "runs", "ranks")


# -- prompt files -----------------------------------------------------------------------------------
def test_default_prompt_set_ships_with_the_package():
    prompts = load_prompts()
    assert len(prompts) == 8
    assert len({p.id for p in prompts}) == 8
    assert {p.kind for p in prompts} == {"raw", "chat"}


def test_grounded_prompt_set_is_selected_by_name(tmp_path, monkeypatch):
    grounded = load_prompts("grounded")
    assert len(grounded) == 8 and {p.kind for p in grounded} == {"chat"}
    assert {p.id for p in grounded}.isdisjoint({p.id for p in load_prompts("default")})
    # Every task hands the model the text its answer copies from: a long user message.
    assert all(len(p.messages[-1]["content"]) > 1200 for p in grounded)
    # A file of that name in the current directory is what a user typing it meant.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grounded").write_text('{"id": "mine", "prompt": "x"}\n')
    assert [p.id for p in load_prompts("grounded")] == ["mine"]
    with pytest.raises(PromptFileError, match="grounded"):
        load_prompts("groundd")


@pytest.mark.parametrize("text, message", [
    ("{not json}\n", "not valid JSON"),
    ('{"id": "a"}\n', "exactly one of"),
    ('{"id": "a", "prompt": "x", "messages": []}\n', "not both"),
    ('{"id": "a", "prompt": ""}\n', "non-empty string"),
    ('{"id": "a", "messages": [{"role": "robot", "content": "x"}]}\n', "messages[0]"),
    ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate id 'a'"),
    ("[1, 2]\n", "expected a JSON object"),
    ("\n# only a comment\n", "no prompts"),
])
def test_malformed_prompt_files_name_the_line(text, message):
    with pytest.raises(PromptFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_prompts(text, "p.jsonl")


def test_prompt_parsing_keeps_ids_and_kinds():
    ps = parse_prompts('# c\n{"id": "r", "prompt": "hi"}\n\n{"id": 7, "messages": [{"role": "user", "content": "yo"}]}\n')
    assert [(p.id, p.kind) for p in ps] == [("r", "raw"), ("7", "chat")]


# -- schedule and statistics ------------------------------------------------------------------------
def test_schedule_interleaves_modes_and_puts_warmup_first():
    ps = parse_prompts('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    items = build_schedule(ps, ["iterative", "speculative", "pipeinfer"], repeat=2, warmup=1)
    assert [(i.prompt.id, i.mode[0], i.repeat, i.warmup) for i in items] == [
        ("a", "i", 0, True), ("a", "s", 0, True), ("a", "p", 0, True),
        ("a", "i", 0, False), ("a", "s", 0, False), ("a", "p", 0, False),
        ("b", "i", 0, False), ("b", "s", 0, False), ("b", "p", 0, False),
        ("a", "i", 1, False), ("a", "s", 1, False), ("a", "p", 1, False),
        ("b", "i", 1, False), ("b", "s", 1, False), ("b", "p", 1, False),
    ]
    assert [i.index for i in items] == list(range(len(items)))


def _rec(index, pid, mode, tps, tokens, warmup=False):
    return {"index": index, "prompt_id": pid, "mode": mode, "repeat": 0, "warmup": warmup, "tokens": tokens,
            "n_gen": len(tokens), "tok_per_s": tps, "decode_tok_per_s": tps * 1.5, "ttft_s": 0.1,
            "itl_ms": {"mean": 10.0, "p50": 9.0, "p90": 20.0},
            "acceptance": {"drafted": 4, "accepted": 3, "rate": 0.75, "mean_accepted_len": 3.0},
            "runs": {"launched": 5, "speculative": 2, "cancelled": 1, "cancelled_mid_compute": 0, "layer_evals_skipped": 0}}


def test_token_check_and_paired_speedups():
    recs = [_rec(0, "a", "iterative", 10.0, [1, 2, 3]), _rec(1, "a", "speculative", 20.0, [1, 2, 3]),
            _rec(2, "b", "iterative", 40.0, [4, 5]), _rec(3, "b", "speculative", 20.0, [4, 6]),
            _rec(4, "b", "speculative", 999.0, [4, 6], warmup=True)]
    mismatches = check_tokens(recs, ["iterative", "speculative"])
    assert [(m["prompt_id"], m["mode"], m["first_diff"], m["got"], m["expected"], m["warmup"]) for m in mismatches] == [
        ("b", "speculative", 1, 6, 5, False), ("b", "speculative", 1, 6, 5, True)]
    assert [r["tokens_match"] for r in recs] == [True, True, True, False, False]
    s = summarize(recs, ["iterative", "speculative"], mismatches)
    assert s["speculative"]["n_records"] == 2  # the warmup is left out
    assert s["speculative"]["tok_per_s"] == {"median": 20.0, "min": 20.0, "max": 20.0}
    assert s["speculative"]["speedup"]["vs_iterative"] == pytest.approx(1.0)  # sqrt(2 * 0.5), paired by prompt
    assert s["iterative"]["speedup"]["vs_speculative"] == pytest.approx(1.0)
    assert s["speculative"]["acceptance"]["rate"] == 0.75
    assert s["speculative"]["mismatched_prompts"] == ["b"]
    assert s["iterative"]["mismatched_prompts"] == []


# -- bad input fails before any model is resolved or loaded ------------------------------------------
@pytest.fixture
def no_models(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("bench resolved/loaded a model before rejecting bad input")

    monkeypatch.setattr(bench_cmd, "prepare_job", forbidden)  # the set-up that resolves (and pulls) the models


def _one_error_line(r) -> str:
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2, r.output  # usage errors
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    return lines[0]


def test_missing_prompt_file(no_models, tmp_path):
    line = _one_error_line(runner.invoke(app, ["bench", MODEL, "--prompts", str(tmp_path / "nope.jsonl")]))
    assert "does not exist" in line


def test_malformed_prompt_file(no_models, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "ok", "prompt": "x"}\n{"id": "oops", "prompt": \n')
    line = _one_error_line(runner.invoke(app, ["bench", MODEL, "--prompts", str(p)]))
    assert f"{p}:2" in line and "not valid JSON" in line


@pytest.mark.parametrize("modes, message", [("iterative,turbo", "unknown mode 'turbo'"), ("iterative,iterative", "more than once"),
                                            (",", "--modes is empty")])
def test_bad_modes(no_models, modes, message):
    assert message in _one_error_line(runner.invoke(app, ["bench", MODEL, "--modes", modes]))


@pytest.mark.parametrize("opt", ["--json", "--csv", "--trace", "--plot"])
def test_unwritable_outputs(no_models, tmp_path, opt):
    line = _one_error_line(runner.invoke(app, ["bench", MODEL, opt, str(tmp_path / "missing-dir" / "out")]))
    assert opt in line and "does not exist" in line
    line = _one_error_line(runner.invoke(app, ["bench", MODEL, opt, str(tmp_path)]))
    assert "is a directory" in line
    line = _one_error_line(runner.invoke(app, ["bench", MODEL, opt, "/proc/pipeinfer-bench.out"]))
    assert "cannot write in /proc" in line


def test_same_output_twice(no_models, tmp_path):
    line = _one_error_line(runner.invoke(app, ["bench", MODEL, "--json", str(tmp_path / "a"), "--csv", str(tmp_path / "a")]))
    assert "both write" in line


# -- real MPI runs on SmolLM2 (draft = itself), 2 ranks, 2 prompts ------------------------------------
MODES = ["iterative", "speculative", "pipeinfer"]


def _bench(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", MODEL, "--draft", MODEL, "--modes", ",".join(MODES),
           "--limit", "2", "-n", "16", "--repeat", "1", "--warmup", "0", "--ranks", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=out,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def bench_run(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    r = _bench(out, "--json", "b.json", "--csv", "b.csv", "--trace", "b.trace.json", "--plot", "b.png")
    assert r.returncode == 0, r.stderr
    return out, r


@pytest.mark.mpi
def test_bench_table_and_json(bench_run):
    out, r = bench_run
    for m in MODES:
        assert m in r.stdout
    assert "× iterative" in r.stdout and "× speculative" in r.stdout
    doc = json.loads((out / "b.json").read_text())
    assert doc["schema"] == "pipeinfer-bench/1"
    assert doc["tokens_identical"] is True and doc["token_mismatches"] == []
    h = doc["header"]
    for k in ("pipeinfer", "llama_cpp_python", "ggml", "mpi4py", "mpi_library"):
        assert h["versions"][k], k
    assert len(h["models"]["target"]["sha256"]) == 64
    assert h["topology"]["world_size"] == 2 and [x["role"] for x in h["topology"]["ranks"]] == ["head", "stage"]
    assert h["host"]["cpu_model"] and h["host"]["cores"] >= 1 and h["host"]["hostname"]
    assert h["config"]["prompts"]["count"] == 2
    recs = doc["records"]
    assert [(x["prompt_id"], x["mode"]) for x in recs] == [(p, m) for p in ("csv-parse", "binary-search") for m in MODES]
    for x in recs:
        for k in METRICS:
            assert k in x, k
        assert x["n_gen"] >= 1 and x["tok_per_s"] > 0 and x["tokens_match"] is True
        assert set(x["acceptance"]) == {"drafted", "accepted", "rate", "mean_accepted_len"}
        assert set(x["runs"]) >= {"launched", "speculative", "cancelled", "cancelled_mid_compute", "layer_evals_skipped"}
        for rk in x["ranks"]:
            assert {"rank", "role", "layers", "threads", "peak_rss_mib", "busy_s"} <= set(rk) and "trace" not in rk
            # Waits sleep by default (and these ranks, with the draft model's thread beside the
            # head's engine, share the cores, so they may not stay awake even when asked).
            assert rk["wait"] == "sleep"
    spec = [x for x in recs if x["mode"] == "speculative"]
    assert all(x["acceptance"]["rate"] == 1.0 for x in spec)  # the draft is the target itself
    for m in MODES:
        s = doc["summary"][m]
        assert s["n_records"] == 2 and s["tok_per_s"]["median"] > 0
        assert set(s["speedup"]) == {"vs_iterative", "vs_speculative"}
    for m in ("iterative", "speculative"):
        assert doc["summary"][m]["speedup"][f"vs_{m}"] == pytest.approx(1.0)


@pytest.mark.mpi
def test_bench_reports_drafting_and_where_each_rank_s_cpu_went(bench_run):
    out, r = bench_run
    assert "drafted/tok" in r.stdout and "head own CPU" in r.stdout
    doc = json.loads((out / "b.json").read_text())
    for x in doc["records"]:
        d = x["drafting"]
        if x["mode"] == "iterative":
            assert d["proposed"] == d["launched"] == 0
        else:
            assert d["proposed"] >= d["launched"] >= x["acceptance"]["drafted"] > 0
            assert d["proposed_per_committed"] == pytest.approx(d["proposed"] / x["n_gen"])
        for rk in x["ranks"]:
            split = rk["cpu_split"]
            assert set(split) == {"stage_s", "draft_s", "own_s", "own_wait_s"}
            assert all(v >= 0 for v in split.values()) and split["own_wait_s"] <= split["own_s"]
            # The kinds add up to the rank's CPU seconds (cpu_s is rounded to 1 ms, each kind to 0.1 ms).
            assert split["stage_s"] + split["draft_s"] + split["own_s"] == pytest.approx(rk["cpu_s"], abs=2e-3)
            assert split["stage_s"] > 0
            if rk["role"] == "stage" or x["mode"] == "iterative":
                assert split["draft_s"] == 0  # the draft model runs on the head only, and only when drafting
            else:
                assert split["draft_s"] > 0
    for m in MODES:
        s = doc["summary"][m]
        head = s["cpu_split"]["0"]
        assert head["role"] == "head" and 0 <= head["own_share"] <= 1
        assert head["stage_s"] + head["draft_s"] + head["own_s"] == pytest.approx(head["cpu_s"], abs=2e-3 * 2)
        assert (s["drafting"]["proposed_per_committed"] > 0) == (m != "iterative")


@pytest.mark.mpi
def test_bench_csv(bench_run):
    out, _ = bench_run
    text = (out / "b.csv").read_text()
    header = [line for line in text.splitlines() if line.startswith("# ")]
    assert any(line.startswith("# versions.ggml: ") for line in header)
    assert any(line.startswith("# models.target.sha256: ") for line in header)
    rows = list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))
    assert len(rows) == 2 * len(MODES)
    doc = json.loads((out / "b.json").read_text())
    for row, rec in zip(rows, doc["records"]):
        assert row["prompt_id"] == rec["prompt_id"] and row["mode"] == rec["mode"]
        for col in ("n_prompt", "n_gen", "ttft_s", "tok_per_s", "decode_tok_per_s", "itl_ms.mean", "itl_ms.p50", "itl_ms.p90",
                    "acceptance.drafted", "acceptance.accepted", "runs.launched", "runs.cancelled", "runs.cancelled_mid_compute",
                    "runs.layer_evals_skipped", "rank0.busy_s", "rank1.busy_s", "rank1.peak_rss_mib",
                    "drafting.proposed", "rank0.cpu_split.own_s", "rank1.cpu_split.stage_s"):
            float(row[col])
        assert float(row["tok_per_s"]) == pytest.approx(rec["tok_per_s"])
        assert row["tokens_match"] == "True"
    assert len({r["tokens_sha1"] for r in rows if r["prompt_id"] == "csv-parse"}) == 1


@pytest.mark.mpi
@pytest.mark.mpi
def test_draft_prefills_while_the_stages_prefill_the_target(bench_run):
    """The head processes the prompt with its draft model while rank 1 is still computing the
    target's prompt, so the draft does not add its prefill to the time to first token."""
    out, _ = bench_run
    events = json.loads((out / "b.trace.json").read_text())["traceEvents"]
    checked = 0
    for mode in ("speculative", "pipeinfer"):
        for prompt in ("csv-parse", "binary-search"):
            mine = [e for e in events if e["ph"] != "M" and e["args"].get("mode") == mode and e["args"].get("prompt") == prompt]
            draft = [e for e in mine if e["pid"] == 0 and e["name"] == "draft prefill"]
            stage = [e for e in mine if e["pid"] == 1 and e["ph"] == "X" and e["name"].startswith("prefill")]
            assert len(draft) == 1 and stage, (mode, prompt)
            assert draft[0]["ts"] < max(e["ts"] + e["dur"] for e in stage), (mode, prompt)
            checked += 1
    assert checked == 4


def test_bench_trace_is_chrome_trace_with_one_track_per_rank(bench_run):
    out, _ = bench_run
    trace = json.loads((out / "b.trace.json").read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        assert e["ph"] in ("X", "i", "M")
        if e["ph"] != "M":
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and "head" in names[0] and "stage" in names[1]
    assert {(e["pid"], e["tid"]) for e in events} == {(0, 0), (1, 1)}  # one track per rank
    runs = {pid: {e["args"]["run"] for e in events if e["ph"] == "X" and e["pid"] == pid and "run" in e["args"]}
            for pid in (0, 1)}
    skipped = {e["args"]["run"] for e in events if e["ph"] == "i" and e["name"].startswith("skip")}
    doc = json.loads((out / "b.json").read_text())
    assert len(runs[0]) == sum(x["runs"]["launched"] for x in doc["records"])  # a slice for every run ...
    assert runs[1] | skipped == runs[0]  # ... on every stage (or its skip, if cancelled before it started there)
    assert any(e["name"].startswith("verify") for e in events) and any(e["name"] == "draft" for e in events)
    assert any(e["ph"] == "i" and e["name"].startswith("commit") for e in events)
    # Transfers: the head sends every run to rank 1, and rank 1 (the last stage) returns each
    # run's result to the head (a few bytes: token ids, not logits).
    sends = {pid: {e["args"]["run"]: e["args"] for e in events if e["ph"] == "i" and e["name"].startswith("send r")
                   and e["pid"] == pid} for pid in (0, 1)}
    assert set(sends[0]) == runs[0] and all(a["to"] == 1 for a in sends[0].values())
    assert set(sends[1]) == runs[0] and all(a["to"] == 0 and 24 <= a["bytes"] < 24 + 8 * 16 for a in sends[1].values())
    # Slices on one track nest properly (Perfetto drops partially overlapping ones).
    for pid in (0, 1):
        stack: list[float] = []
        for e in sorted((e for e in events if e["ph"] == "X" and e["pid"] == pid), key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-3, e
            stack.append(e["ts"] + e["dur"])
    # Aligned clocks: a run starts on the stage after it started on the head.
    start = {(e["pid"], e["args"]["run"]): e["ts"] for e in events if e["ph"] == "X" and "run" in e["args"]}
    assert all(start[(1, r)] >= start[(0, r)] for r in runs[0])


@pytest.mark.mpi
def test_bench_png_opens_with_the_right_size(bench_run):
    from pipeinfer_cli.bench.plot import figure_size_px

    data = (Path(bench_run[0]) / "b.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == figure_size_px(len(MODES))
    import matplotlib.image

    assert matplotlib.image.imread(str(Path(bench_run[0]) / "b.png")).shape[:2] == (height, width)


@pytest.mark.mpi
def test_bench_reports_a_forced_divergence(smollm2_path, tmp_path):
    r = _bench(tmp_path, "--json", "d.json", env={"PIPEINFER_DEBUG_DIVERGE": "pipeinfer"})
    assert r.returncode == 1
    assert "DIFFER" in r.stdout  # in the table
    assert "TOKENS DIFFER: prompt 'csv-parse': pipeinfer" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: modes generated different tokens on 2 prompts")
    doc = json.loads((tmp_path / "d.json").read_text())  # written anyway
    assert doc["tokens_identical"] is False
    assert sorted((m["prompt_id"], m["mode"]) for m in doc["token_mismatches"]) == [
        ("binary-search", "pipeinfer"), ("csv-parse", "pipeinfer")]
    assert doc["summary"]["pipeinfer"]["mismatched_prompts"] == ["binary-search", "csv-parse"]
    assert doc["summary"]["iterative"]["mismatched_prompts"] == []
    assert [x["tokens_match"] for x in doc["records"] if x["mode"] == "pipeinfer"] == [False, False]


@pytest.mark.mpi
def test_update_benchmarks_rewrites_only_its_section(bench_run, tmp_path):
    out, _ = bench_run
    doc = json.loads((out / "b.json").read_text())
    iterative = [r for r in doc["records"] if r["mode"] == "iterative"]
    baseline = {"command": "python -m benchmarks.llamacpp x", "threads": doc["header"]["topology"]["threads_total"],
                "versions": doc["header"]["versions"], "median": {"tok_per_s": 10.0, "decode_tok_per_s": 12.0},
                "records": [{"prompt_id": r["prompt_id"], "tokens": r["tokens"], "tok_per_s": 10.0, "decode_tok_per_s": 12.0}
                            for r in iterative]}
    (tmp_path / "base.json").write_text(json.dumps(baseline))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bench.png").write_bytes((out / "b.png").read_bytes())
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nWritten by hand.\n")
    for _ in range(2):  # the second run replaces the section instead of appending another
        subprocess.run([sys.executable, "-m", "benchmarks.update_md", str(out / "b.json"), "--baseline",
                        str(tmp_path / "base.json"), "--plot", str(tmp_path / "docs" / "bench.png"), "--out", str(md)],
                       check=True, capture_output=True, cwd=Path(__file__).parents[1])
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nWritten by hand.\n")
    assert text.count("<!-- bench:begin -->") == 1 and text.rstrip().endswith("<!-- bench:end -->")
    assert doc["header"]["command"] in text and doc["header"]["host"]["cpu_model"] in text
    for m in MODES:
        assert f"| `{m}` |" in text
    assert "identical to pipeinfer's `iterative` mode" in text
    ratio = statistics.geometric_mean(r["tok_per_s"] for r in iterative) / 10.0  # one repeat: medians are the values
    assert f"| `iterative` | {ratio:.2f}× |" in text  # ratio to llama.cpp, paired by prompt
    assert "![tokens/s per mode and per-rank timelines](docs/bench.png)" in text


# -- header facts and trace layout without MPI --------------------------------------------------------
def test_model_facts_use_the_registry_checksum_or_compute_one(tmp_path):
    import hashlib

    from pipeinfer_cli.bench.environment import model_facts

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(1000))
    computed = model_facts("m.gguf", f, None)
    assert computed["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() and computed["sha256_source"] == "computed"
    assert model_facts("reg", f, "ab" * 32)["sha256"] == "ab" * 32
    assert model_facts("lookup", None, None) == {"name": "lookup", "path": None, "sha256": None}


def test_trace_moves_every_rank_onto_the_head_clock():
    from pipeinfer_cli.bench.chrome_trace import build_trace

    # Rank 1's perf_counter runs 100 s ahead of the head's.
    rec = _rec(0, "a", "speculative", 10.0, [1, 2])
    rec.update(t_start=5.0, t_end=5.5, ranks=[
        {"rank": 0, "role": "head", "layers": [0, 10], "threads": 1, "clock_offset_s": 0.0,
         "trace": [("X", "stage", 5.1, 5.2, {"run": 1, "n_tokens": 3, "spec": True}), ("i", "cancel", 5.25, 5.25, {"runs": [2]})]},
        {"rank": 1, "role": "stage", "layers": [10, 20], "threads": 1, "clock_offset_s": 100.0,
         "trace": [("X", "stage", 105.2, 105.3, {"run": 1, "n_tokens": 3, "spec": True, "cancelled": False}),
                   ("i", "skip", 105.3, 105.3, {"run": 2})]},
    ])
    events = build_trace([rec])["traceEvents"]
    by_name = {(e["pid"], e["name"]): e for e in events if e["ph"] != "M"}
    assert by_name[(0, "verify r1")]["ts"] == pytest.approx(0.1e6) and by_name[(0, "verify r1")]["dur"] == pytest.approx(0.1e6)
    assert by_name[(1, "verify r1")]["ts"] == pytest.approx(0.2e6)
    assert by_name[(1, "skip r2")]["ph"] == "i" and by_name[(1, "skip r2")]["ts"] == pytest.approx(0.3e6)
    assert by_name[(0, "cancel")]["args"]["runs"] == [2]
    assert by_name[(0, "a · speculative")]["dur"] == pytest.approx(0.5e6)  # the request, enclosing its runs
    assert by_name[(1, "verify r1")]["args"] == {"run": 1, "n_tokens": 3, "speculative": True, "cancelled": False,
                                                 "prompt": "a", "mode": "speculative", "repeat": 0, "warmup": False}


@pytest.mark.slow
def test_grounded_prompts_are_400_to_550_qwen_tokens(qwen15_path):
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    tok = Tokenizer(qwen15_path)
    lengths = {p.id: len(tok.chat_messages(list(p.messages))) for p in load_prompts("grounded")}
    assert all(400 <= n <= 550 for n in lengths.values()), lengths

"""`pipeinfer generate` input handling as a new user meets it: llama.cpp habits (-m MODEL, -n -1),
bad option values and bad text as one `Error:` line, prompts from stdin / JSON messages / a system
prompt, stop strings, min_p, the default mode, and the summary line.

Checks that fail before any model loads run in-process with CliRunner; generation runs are real
processes (some under mpiexec) on SmolLM2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeinfer_cli.cli.app import app
from pipeinfer_cli.cli.generate_cmd import summary_line
from pipeinfer_cli.decode.cpu_account import CpuSplit
from pipeinfer_cli.decode.metrics import Acceptance, DraftWork, GenerationMetrics, ProcessStats, RunCounters
from pipeinfer_cli.decode.result import GenerationResult, RankReport
from pipeinfer_cli.decode.sampling import SamplingParams, sample
from pipeinfer_cli.decode.text_stream import TextStream

runner = CliRunner()
MODEL = "smollm2-135m-instruct"


def one_error_line(r, code: int) -> str:
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert r.stdout == ""
    return lines[0]


# -- option values: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["-n", "0"], "-n/--n-predict"),
    (["-n", "-5"], "-n/--n-predict"),
    (["--ranks", "0"], "--ranks"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "2"], "--top-p"),
    (["--min-p", "1.5"], "--min-p"),
    (["--ctx", "10"], "--ctx"),
    (["-M", "fast"], "unknown --mode 'fast'"),
    (["--spec-policy", "never"], "unknown --spec-policy 'never'; choose one of auto, always"),
])
def test_bad_option_value_is_one_line_exit_2(smollm2_path, args, words):
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "hi", *args]), 2)
    assert words in line


@pytest.mark.parametrize("args", [["--spec-policy"], ["--bogus"], ["--top-k", "x"]])
def test_a_usage_error_points_at_the_subcommands_help(args):
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "hi", *args]), 2)
    assert line.endswith(" generate --help`)"), line


# -- the prompt ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["-p", ""], ["--chat", ""]])
def test_empty_prompt_and_empty_chat_are_refused_alike(smollm2_path, args):
    assert "the prompt is empty" in one_error_line(runner.invoke(app, ["generate", MODEL, *args]), 2)


@pytest.mark.parametrize("args", [["--chat", "Hi"], ["--system", "Be brief.", "--chat", "Hi"], ["--messages", "MSGS"],
                                  ["--chat", "Hi", "--ranks", "2"]], ids=["chat", "system", "messages", "ranks"])
def test_chat_on_a_model_without_a_template_says_to_use_p(gemma3_path, tmp_path, args):
    """Gemma 3 270M is a base model: its GGUF has no chat template."""
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    args = [str(msgs) if a == "MSGS" else a for a in args]
    line = one_error_line(runner.invoke(app, ["generate", "gemma3-270m", *args]), 2)
    assert "gemma3-270m has no chat template" in line and "-p/--prompt" in line


def test_invalid_utf8_file_names_file_and_offset(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello \xff\xfe world")
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-f", str(junk)]), 2)
    assert str(junk) in line and "offset 6" in line and "0xff" in line


def test_invalid_utf8_argument_names_offset():
    # Python hands undecodable argv bytes over as lone surrogates (surrogateescape).
    bad = b"abc\xe9".decode("utf-8", "surrogateescape")
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-p", bad]), 2)
    assert "-p/--prompt" in line and "offset 3" in line


def test_exactly_one_prompt_source():
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "a", "--chat", "b"]), 2)
    assert "exactly one of" in line and "-p/--prompt and --chat" in line


def test_system_needs_a_chat():
    assert "--system needs --chat" in one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "a", "--system", "s"]), 2)


@pytest.mark.parametrize("content, words", [
    ("not json", "not valid JSON"),
    ("[]", "non-empty JSON list"),
    ('[{"role": "robot", "content": "x"}]', "role 'robot'"),
    ('[{"role": "user"}]', 'string "role" and "content"'),
])
def test_bad_messages_file(tmp_path, content, words):
    f = tmp_path / "m.json"
    f.write_text(content)
    assert words in one_error_line(runner.invoke(app, ["generate", MODEL, "--messages", str(f)]), 2)


def test_model_option_and_argument():
    assert "two models given" in one_error_line(runner.invoke(app, ["generate", MODEL, "-m", "other", "-p", "x"]), 2)
    assert "no model given" in one_error_line(runner.invoke(app, ["generate", "-p", "x"]), 2)


def test_split_too_fine_fails_before_any_process_starts(smollm2_path):
    # 30 layers over 100 ranks: refused from the GGUF header, in-process (nothing was launched).
    line = one_error_line(runner.invoke(app, ["generate", "-m", MODEL, "-p", "hi", "--ranks", "100"]), 2)
    assert "cannot split 30 layers over 100 ranks" in line


def test_ctx_error_in_iterative_mode_does_not_mention_speculation(smollm2_path):
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "hello there", "--ctx", "16", "-n", "40"]), 2)
    assert "speculat" not in line and "--ctx 16" in line and "lower -n" in line


def test_draft_rank_without_a_draft_is_refused(smollm2_path):
    line = one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "hi", "--layer-split", "1/1"]), 2)
    assert "draft rank" in line


@pytest.mark.parametrize("stop, words", [("", "--stop needs some text"),
                                         (b"\xc3".decode("utf-8", "surrogateescape"), "the text of --stop")])
def test_bad_stop_strings(smollm2_path, stop, words):
    assert words in one_error_line(runner.invoke(app, ["generate", MODEL, "-p", "hi", "--stop", stop]), 2)


def test_messages_from_stdin_errors_say_standard_input():
    r = runner.invoke(app, ["generate", MODEL, "--messages", "-"], input="not json")
    assert "standard input is not valid JSON" in one_error_line(r, 2)


# -- pure pieces ------------------------------------------------------------------------------------
def test_stop_strings_are_cut_and_held_back():
    pieces = {1: b"Hel", 2: b"lo, wor", 3: b"ld! END", 4: b" more"}
    ts = TextStream(pieces.__getitem__, ["END", "lo, x"])
    shown = [ts.push(t) for t in (1, 2, 3)]
    # The "l" of "Hel" could begin "lo, x": it is held back until the next token rules that out.
    assert shown[0] == "He" and "".join(shown) == "Hello, world! "
    assert ts.stopped and ts.stop_string == "END" and ts.text == "Hello, world! "
    assert ts.push(4) == "" and ts.finish() == ""


def test_text_stream_completes_utf8_across_tokens():
    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:] + b"!"}
    ts = TextStream(pieces.__getitem__)
    assert ts.push(1) == "" and ts.push(2) == "é!" and ts.finish() == ""


def test_min_p_drops_unlikely_tokens():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float64)).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.35, seed=3)
    picks = {sample(logits, params, pos) for pos in range(400)}
    assert picks == {0, 1}  # 0.15 < 0.35 * 0.5
    assert {sample(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3), p) for p in range(400)} == {0, 1, 2, 3}


def test_itl_counts_gaps_between_arrivals():
    m = GenerationMetrics(t_start=0.0)
    m.token_times = [1.0, 1.1, 1.1, 1.1, 1.3]  # one token, then a run of three, then one
    d = m.to_dict()
    assert d["itl_ms"]["p50"] == pytest.approx(150.0) and d["itl_ms"]["mean"] == pytest.approx(150.0)


def test_summary_line_plurals_and_layer_ranges():
    r = GenerationResult(
        prompt_id="", mode="pipeinfer", model="m", draft="d", layer_split="14,1", n_ctx=64, text="x", tokens=[1],
        finish_reason="length", n_prompt=3, n_gen=1, ttft_s=0.1, tok_per_s=2.0, decode_tok_per_s=None, itl_ms=None,
        acceptance=Acceptance(), runs=RunCounters(cancelled=1), wire={}, t_start=0.0, t_end=1.0,
        ranks=[RankReport(i, "stage", layers, 1, 0.0, 0.0, 0.0, 0, "spin", ProcessStats())
               for i, layers in enumerate([[0, 14], [14, 15], None])])
    line = summary_line(r)
    assert "1 token," in line and "1 run cancelled" in line
    assert "3 ranks (layers 0-13, 14, draft)" in line and "split" not in line
    assert "drafting" not in line
    r.runs = RunCounters(cancelled=0, drafting_paused=2)
    assert "drafting paused 2 times" in summary_line(r)
    r.runs = RunCounters(cancelled=0, drafting_paused=1, drafting_ended=True)
    line = summary_line(r)
    assert "drafting off (cannot pay on one stage" in line and "paused" not in line


def test_summary_line_says_where_the_head_s_cpu_went_and_how_much_was_drafted():
    split = CpuSplit(stage_s=1.5, draft_s=4.5, own_s=0.0625, own_wait_s=0.03)
    head = RankReport(0, "head", [0, 9], 1, 0.0, 0.0, 6.06, 0, "sleep", ProcessStats(), cpu_split=split)
    r = GenerationResult(
        prompt_id="", mode="pipeinfer", model="m", draft="d", layer_split="9,19", n_ctx=64, text="x", tokens=[1] * 8,
        finish_reason="length", n_prompt=3, n_gen=8, ttft_s=0.1, tok_per_s=2.0, decode_tok_per_s=None, itl_ms=None,
        acceptance=Acceptance(), runs=RunCounters(), wire={}, t_start=0.0, t_end=1.0, ranks=[head],
        drafting=DraftWork(proposed=10, launched=9))
    line = summary_line(r)
    assert "1.25 drafted per token" in line
    assert "head CPU 6.1 s (layers 25%, draft 74%, own 1%)" in line
    r.ranks, r.drafting = [RankReport(0, "head", [0, 9], 1, 0.0, 0.0, 0.0, 0, "sleep", ProcessStats())], DraftWork()
    assert "head CPU" not in summary_line(r) and "drafted per token" not in summary_line(r)


# -- real runs ---------------------------------------------------------------------------------------
def gen(*args, stdin: str | None = None, timeout: float = 180) -> dict:
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", *map(str, args), "--json", "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_draft_without_mode_runs_pipeinfer(smollm2_path):
    r = gen(MODEL, "--draft", "lookup", "-p", "The capital of France is", "-n", 8)
    assert r["mode"] == "pipeinfer"
    assert gen(MODEL, "-p", "The capital of France is", "-n", 8)["mode"] == "iterative"


@pytest.mark.mpi
def test_prompt_from_stdin_on_two_ranks(smollm2_path):
    text = "def fibonacci(n):\n    " * 3
    want = gen(MODEL, "-p", text, "-n", 8)
    got = gen("-m", MODEL, "-f", "-", "-n", 8, "--ranks", 2, stdin=text)
    assert got["n_prompt"] == want["n_prompt"] and got["tokens"] == want["tokens"]


def test_system_prompt_and_messages_file_agree(smollm2_path, tmp_path):
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": "Name a colour."}]))
    a = gen(MODEL, "--messages", msgs, "-n", 8)
    b = gen(MODEL, "--chat", "Name a colour.", "--system", "Answer in French.", "-n", 8)
    c = gen(MODEL, "--chat", "Name a colour.", "-n", 8)
    # (SmolLM2's template writes a default system prompt of its own when none is given.)
    assert a["tokens"] == b["tokens"] and a["n_prompt"] == b["n_prompt"] != c["n_prompt"]


@pytest.mark.mpi
def test_stop_string_ends_generation_identically_in_every_mode(smollm2_path):
    base = gen(MODEL, "--chat", "Write three sentences about rivers.", "-n", 48)
    text = base["text"]
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert len(stop) == 4 and stop.strip()
    want_text = text[:text.index(stop)]
    for args in ([], ["--draft", MODEL, "-M", "speculative"], ["--draft", "lookup", "--ranks", 2]):
        r = gen(MODEL, "--chat", "Write three sentences about rivers.", "-n", 48, "--stop", stop, *args)
        assert r["text"] == want_text and r["finish_reason"] == "stop"
        assert r["tokens"] == base["tokens"][:len(r["tokens"])] and len(r["tokens"]) < len(base["tokens"])


def test_n_minus_one_runs_until_the_context_is_full(smollm2_path):
    r = gen(MODEL, "-p", "1, 2, 3, 4,", "-n", -1, "--ctx", 48)
    assert r["finish_reason"] in ("stop", "length")
    if r["finish_reason"] == "length":
        assert r["n_prompt"] + r["n_gen"] == 48 - 1
    assert r["n_gen"] >= 1


@pytest.mark.parametrize("ranks", [1, 2])
def test_piped_text_ends_with_one_newline_and_json_is_unchanged(smollm2_path, ranks):
    """`pipeinfer generate … > out.txt`: the text, then one newline (a file a shell prints whole);
    the summary goes to stderr; --json is one JSON document ending in a newline."""
    args = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "-p", "The capital of France is",
            "-n", 12, "--ranks", ranks, "--threads", 1, "--no-pull"]
    plain = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=120)
    as_json = subprocess.run(list(map(str, args + ["--json"])), capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and as_json.returncode == 0, plain.stderr + as_json.stderr
    result = json.loads(as_json.stdout)
    assert as_json.stdout.endswith("}\n") and not as_json.stdout.endswith("\n\n")
    assert plain.stdout == result["text"] + "\n", (plain.stdout, result["text"])
    assert "pipeinfer: " in plain.stderr and result["text"] not in plain.stderr

"""`pipeinfer plan`, `--layer-split auto` and `-M auto` as a user runs them (SmolLM2, a profile made
by hand with its header's facts, so that nothing here depends on this machine's speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planning import smollm2_profile


def run(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def profile(smollm2_path, tmp_path_factory):
    """Two ranks, the second twice as slow, for SmolLM2's header."""
    return smollm2_profile(smollm2_path, tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def trace(smollm2_path, profile, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.json"
    r = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "-p", "1, 2, 3, 4, 5, 1, 2, 3,", "-n", 24,
            "--record", path)
    assert r.returncode == 0, r.stderr
    assert "trace written to" in r.stderr
    return path


def test_plan_table_and_json_per_mode(smollm2_path, profile, trace):
    r = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "--trace", trace, "--json")
    assert r.returncode == 0, r.stderr
    modes = json.loads(r.stdout)["modes"]
    assert list(modes) == ["iterative", "speculative", "pipeinfer"]
    for m in modes.values():
        assert m["tok_per_s"] > 0 and m["ttft_s"] > 0 and m["itl_ms"]["p50"] > 0
        assert m["settings"]["layer_split"] and m["n_gen"] == 24
        # Per prompt, the fields of `generate --json`, in its units.
        p = m["predictions"][0]
        assert {"tok_per_s", "ttft_s", "itl_ms", "decode_tok_per_s", "acceptance", "runs", "n_gen"} <= set(p)
    assert modes["iterative"]["acceptance"]["drafted"] == 0 and modes["pipeinfer"]["acceptance"]["drafted"] > 0
    table = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "--trace", trace)
    assert table.returncode == 0 and "predicted:" in table.stdout and "pipeinfer" in table.stdout


def test_layer_split_auto_gives_the_slow_rank_fewer_layers(smollm2_path, profile, trace):
    r = run("plan", smollm2_path, "--profile", profile, "--trace", trace, "--modes", "iterative", "--json",
            "--layer-split", "auto")
    split = json.loads(r.stdout)["modes"]["iterative"]["settings"]["layer_split"]
    first, second = map(int, split.split(","))
    assert first == 2 * second  # SmolLM2's 30 layers: 20 on the fast rank, 10 on the one twice as slow


@pytest.mark.parametrize("args, message", [
    (["--trace", "missing.trace"], "Error: no trace at missing.trace"),
    (["--ranks", "3", "-p", "Hi"], "the plan has 3 ranks but the profile measured 2 ranks"),
    (["-p", "Hi", "--modes", "fast"], "unknown --modes 'fast'"),
    ([], "nothing to predict for"),
    (["-p", "Hi", "--modes", "iterative,speculative"], "--modes speculative needs a draft: pass --draft MODEL"),
    (["-p", "Hi", "--draft", "gemma3-270m", "--record", "t.trace"], "cannot record the chains of gemma3-270m, a draft of "
                                                                  "another vocabulary, yet"),
])
def test_plan_bad_input_is_one_line(smollm2_path, profile, args, message):
    r = run("plan", smollm2_path, "--profile", profile, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_profile_of_another_model_is_refused(gemma3_path, profile):
    r = run("plan", gemma3_path, "--profile", profile, "-p", "Hi")
    assert r.returncode == 2 and "was measured for test-model" in r.stderr, r.stderr


def test_mode_auto_says_what_it_chose(smollm2_path, profile):
    r = run("generate", smollm2_path, "--draft", "lookup", "-M", "auto", "--profile", profile, "-p", "1, 2, 3,",
            "-n", 8)
    assert r.returncode == 0, r.stderr
    assert "mode auto chose " in r.stderr and "predicted" in r.stderr and "tok/s" in r.stderr
    # Without a profile it calibrates one: tests/test_auto_mode.py.


def test_search_names_each_mode_s_own_settings_and_figures(smollm2_path, profile):
    """--search: iterative has no draft knobs, speculative n_draft alone; a best figure on another split
    than the table's names that split (the draft model on the head takes layers from it in the
    table's job); with the table's split the best iterative figure is the table's."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}

    def plan(draft: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipeinfer_cli", "plan", str(smollm2_path), "--profile",
                               str(profile), "--draft", draft, "--acceptance", "0.7", "-p", "Hi there, how are you",
                               "-n", "8", "--search", "--threads", "2", "--force"],
                              capture_output=True, text=True, timeout=600, env=env)

    r = plan("smollm2-135m-instruct")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    best = {ln.split(":")[0][5:]: ln for ln in lines if ln.startswith("best ")}
    assert "n_draft" not in best["iterative"] and "p_accept" not in best["speculative"], best
    assert "max_inflight" in best["pipeinfer"]
    table = {ln.split()[0]: ln.split() for ln in lines if ln.split() and ln.split()[0] in best}
    if table["iterative"][1] != best["iterative"].split("layers ")[1].split()[0]:
        assert "(the split of `generate -M iterative`)" in best["iterative"]
    r = plan("lookup")  # no draft model: one split for every mode
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    it = next(ln for ln in lines if ln.startswith("best iterative"))
    row = next(ln.split() for ln in lines if ln.startswith("iterative "))
    assert it == f"best iterative: no settings to search (the table's row) -> {row[2]} tok/s", (it, row)


def test_a_piped_table_is_never_cut(monkeypatch):
    """stdout not a terminal and no COLUMNS: rich would fit the table in 80 columns and cut cells to
    '…'; the table comes out whole."""
    import io

    from rich.console import Console
    from rich.table import Table

    from pipeinfer_cli.cli.console import print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    t = Table()
    for i in range(8):
        t.add_column(f"column {i}", no_wrap=True)
    t.add_row(*[f"speculative-{i}" for i in range(8)])
    buf = io.StringIO()
    console = Console(file=buf)
    assert not console.is_terminal and console.width == 80
    print_table(t, console)
    text = buf.getvalue()
    assert "…" not in text and all(f"speculative-{i}" in text for i in range(8)), text
    assert console.width == 80

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

"""`plan --search` and `-M auto`: one search (planner/search.py), one answer for the same profile,
draft and acceptance; a planned mode that never speculated says so; `-M auto` without a profile
calibrates quickly once and reuses the cached profile (SmolLM2, a profile made by hand with its
header's facts except where a calibration is the point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planning import smollm2_profile
from pipeinfer_cli.models.gguf_info import read_model_info
from pipeinfer_cli.planner.identity import model_sha256

PROMPT = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"


def run(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def profile(smollm2_path, tmp_path_factory):
    """Two ranks, the second twice as slow, for SmolLM2's header."""
    return smollm2_profile(smollm2_path, tmp_path_factory.mktemp("auto"))


def _trace(smollm2_path, path, prompt: list[int], n_gen: int):
    """A trace of one request: `prompt`, then n_gen tokens that never repeat (what -M auto plans for)."""
    from pipeinfer_cli.planner.replay import Trace
    from pipeinfer_cli.planner.search import auto_request

    info = read_model_info(smollm2_path)
    Trace({"name": "smollm2", "file_bytes": info.file_size, "sha256": model_sha256(smollm2_path)},
          {"name": "lookup", "kind": "lookup"}, {"temp": 0.0, "seed": 0}, 24, [auto_request(prompt, n_gen)]).save(path)
    return path


def test_plan_search_and_acceptance_through_the_cli(smollm2_path, profile):
    r = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "-p", PROMPT, "-n", 12,
            "--acceptance", 0.7, "--search", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    modes, choice = d["modes"], d["choice"]
    for m in ("speculative", "pipeinfer"):
        assert modes[m]["acceptance"]["drafted"] > 0 and modes[m]["note"] is None
        assert modes[m]["best"]["tok_per_s"] > 0
    assert choice["mode"] in modes
    assert choice["tok_per_s"] == max(s["best"]["tok_per_s"] for s in modes.values())
    table = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "-p", PROMPT, "-n", 12,
                "--acceptance", 0.7, "--search")
    assert table.returncode == 0, table.stderr
    assert "best pipeinfer: n_draft" in table.stdout and f"fastest: {choice['mode']}" in table.stdout
    assert "what -M auto chooses" in table.stdout


def test_a_mode_that_never_speculated_says_why(smollm2_path, profile, tmp_path):
    # Prompt lookup over text that never repeats proposes nothing: pipeinfer runs as iterative does.
    trace = _trace(smollm2_path, tmp_path / "t.json", list(range(500, 540)), 10)
    r = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "--trace", trace, "--search",
            "--json", "--force")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    pi = d["modes"]["pipeinfer"]
    assert pi["acceptance"]["drafted"] == 0 and pi["note"].startswith("never speculated: prompt lookup")
    assert d["choice"]["mode"] == "iterative"
    table = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "--trace", trace, "--force")
    assert "pipeinfer *" in table.stdout and "* pipeinfer: never speculated" in table.stdout


def test_plan_search_and_auto_make_the_same_choice(smollm2_path, profile, tmp_path):
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    g = run("generate", smollm2_path, "--draft", "lookup", "-M", "auto", "--profile", profile, "-p", PROMPT,
            "-n", 12, "--json")
    assert g.returncode == 0, g.stderr
    auto = json.loads(g.stdout)["auto"]
    acc = auto["acceptance"]
    assert acc["measured"] and acc["source"].startswith("measured on the prompt") and 0 < acc["rate"] <= 1
    assert f"on a measured acceptance of {acc['rate']:.0%}" in g.stderr
    tok = Tokenizer(smollm2_path)
    prompt = tok.encode(PROMPT)
    tok.close()
    trace = _trace(smollm2_path, tmp_path / "auto.json", prompt, 12)
    p = run("plan", smollm2_path, "--profile", profile, "--draft", "lookup", "--trace", trace, "--ranks", 1,
            "--acceptance", repr(acc["rate"]), "--search", "--json", "--force")
    assert p.returncode == 0, p.stderr
    choice = json.loads(p.stdout)["choice"]
    assert choice["mode"] == auto["mode"]
    if auto["mode"] != "iterative":
        assert choice["n_draft"] == auto["n_draft"]
    if auto["mode"] == "pipeinfer":
        assert (choice["p_accept"], choice["max_inflight"]) == (auto["p_accept"], auto["max_inflight"])
    assert choice["tok_per_s"] == pytest.approx(auto["predicted_tok_per_s"])


def test_auto_without_a_profile_calibrates_once_then_reuses_it(smollm2_path, tmp_path):
    env = {"PIPEINFER_CACHE": str(tmp_path / "cache")}
    args = ("generate", smollm2_path, "--ranks", 2, "--draft", "lookup", "-M", "auto", "-p", PROMPT, "-n", 6)
    first = run(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert "-M auto: no profile of these ranks yet; calibrating them quickly" in first.stderr
    assert "calibrate: rank 1:" in first.stderr and "--quick" in first.stderr
    kept = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(kept) == 1 and str(kept[0]) in first.stderr
    assert "-M auto chose " in first.stderr and "measured on the prompt" in first.stderr
    second = run(*args, env=env)
    assert second.returncode == 0, second.stderr
    assert f"-M auto: reusing profile {kept[0]}" in second.stderr and "calibrating" not in second.stderr
    assert "-M auto chose " in second.stderr


def test_calibrate_with_a_draft_model_measures_its_acceptance(tiny_pair, tmp_path):
    from pipeinfer_cli.planner.acceptance import from_profile
    from pipeinfer_cli.planner.profile import Profile

    target, draft = tiny_pair
    out = tmp_path / "p.json"
    r = run("calibrate", target, "--draft", draft, "--quick", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "draft acceptance: " in r.stderr
    d = Profile.load(out).draft
    assert d.kind == "model" and 0 <= d.acceptance <= 1 and 0 < d.acceptance_tokens <= 32
    assert len(d.confidence_right) + len(d.confidence_wrong) == d.acceptance_tokens
    acc = from_profile(d)
    assert acc.measured and acc.source.startswith("measured by calibrate")


def test_the_acceptance_auto_plans_with_is_measured_where_it_can_be():
    from types import SimpleNamespace

    from pipeinfer_cli.planner.auto_choice import draft_acceptance
    from pipeinfer_cli.decode.draft_spec import DraftSpec
    from pipeinfer_cli.planner.acceptance import DEFAULT_ACCEPTANCE, lookup_on_prompt
    from pipeinfer_cli.planner.profile import DraftCosts

    on_prompt = lookup_on_prompt([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 9])
    assert on_prompt.measured and on_prompt.rate == 7 / 8 and len(on_prompt.confidences.right) == 7
    assert lookup_on_prompt(list(range(40))).rate == 0.0  # nothing repeats: nothing proposed
    lookup = SimpleNamespace(draft=DraftSpec.parse("lookup"))
    assert draft_acceptance(lookup, None, [1, 2, 1, 2, 1]).measured
    assert not draft_acceptance(lookup, None, None).measured  # chat, serve: no prompt yet
    model = SimpleNamespace(draft=DraftSpec.parse("draft"))
    costs = DraftCosts("model", "draft", 0, 1, 1e-3, 1e-4)
    assert draft_acceptance(model, SimpleNamespace(draft=costs), None).rate == DEFAULT_ACCEPTANCE
    costs.acceptance, costs.acceptance_tokens, costs.confidence_right, costs.confidence_wrong = 0.75, 4, [.9] * 3, [.2]
    got = draft_acceptance(model, SimpleNamespace(draft=costs), None)
    assert got.measured and got.rate == 0.75 and got.confidences.wrong == [.2]


def test_recorded_chains_give_the_confidences():
    from pipeinfer_cli.decode.draft_spec import DraftSpec
    from pipeinfer_cli.planner.acceptance import confidences
    from pipeinfer_cli.planner.replay import PromptTrace

    pt = PromptTrace("p", [1, 2], [3, 4, 5], "length", chains_from=3, chains=[[4, 9], [7]], chain_probs=[[.8, .1], [.3]])
    model = DraftSpec.parse("draft")
    got = confidences(model, None, [pt])
    assert got.right == [.8] and got.wrong == [.3]
    assert confidences(model, None, [PromptTrace("q", [1], [2], "length")]) is None  # nothing measured: the rate


def test_chat_says_what_auto_chose_and_that_its_acceptance_is_assumed(smollm2_path, profile):
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "chat", str(smollm2_path), "--draft", "lookup", "-M",
                        "auto", "--profile", str(profile), "-n", "2"], input="", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("pipeinfer: -M auto chose "))
    assert "on an assumed acceptance of 60% (assumed: prompt lookup, before any prompt is known)" in line


def test_auto_under_the_users_own_mpiexec_calibrates_its_ranks_in_place(smollm2_path, tmp_path):
    """`mpiexec -n 3 pipeinfer generate … -M auto` (no --ranks, no --profile): the running ranks are
    calibrated inside the job, the profile is cached for the next such job, the text is iterative's."""
    import shutil
    from pathlib import Path

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / Path(smollm2_path).name).symlink_to(smollm2_path)
    env = {**os.environ, "PIPEINFER_CACHE": str(cache)}
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    args = ["generate", "smollm2-135m-instruct", "--draft", "lookup", "-p", PROMPT, "-n", "6", "--json"]
    job = [mpiexec, "-n", "3", sys.executable, "-m", "pipeinfer_cli", *args, "-M", "auto"]
    first = subprocess.run(job, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stderr
    assert "-M auto: no profile of these 3 ranks yet; calibrating them quickly inside this job" in first.stderr
    assert "needs a profile" not in first.stderr and "calibrate: rank 2:" in first.stderr
    kept = list((cache / "profiles").glob("*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())["ranks"]) == 3
    auto = json.loads(first.stdout)
    assert auto["auto"]["mode"] and auto["auto"]["acceptance"]["measured"]  # lookup, on the head's prompt
    second = subprocess.run(job, capture_output=True, text=True, timeout=900, env=env)
    assert second.returncode == 0, second.stderr
    assert f"-M auto: reusing profile {kept[0]}" in second.stderr and "calibrating" not in second.stderr
    iterative = run(*args, "-M", "iterative", env={"PIPEINFER_CACHE": str(cache)})
    assert iterative.returncode == 0, iterative.stderr
    assert json.loads(second.stdout)["text"] == auto["text"] == json.loads(iterative.stdout)["text"]


def test_calibrate_with_an_auto_split_does_not_calibrate_twice(smollm2_path, tmp_path):
    """calibrate --layer-split auto measures equal shares: it needs no profile first (it ran the
    quick calibration of -M auto before its own)."""
    env = {"PIPEINFER_CACHE": str(tmp_path / "cache")}
    r = run("calibrate", smollm2_path, "--layer-split", "auto", "--quick", "--out", tmp_path / "p.json", env=env)
    assert r.returncode == 0, r.stderr
    assert "calibrating them quickly" not in r.stderr and not (tmp_path / "cache" / "profiles").exists()
    assert (tmp_path / "p.json").is_file()

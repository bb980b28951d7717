"""-M auto's re-planning between requests (planner/replan.py): the margin, the minimum of drafted
tokens, the running total over the requests so far."""

from __future__ import annotations

import time

from pipeinfer_cli.planner.replan import REPLAN_MARGIN, REPLAN_MIN_DRAFTED, MeasuredAcceptance


def test_a_rate_within_the_margin_keeps_the_plan():
    m = MeasuredAcceptance(0.6)
    m.add(100, round(100 * (0.6 + REPLAN_MARGIN - 0.01)))
    assert not m.should_replan()


def test_too_few_drafted_tokens_do_not_count_however_far_off():
    m = MeasuredAcceptance(0.6)
    m.add(REPLAN_MIN_DRAFTED - 1, REPLAN_MIN_DRAFTED - 1)  # 100 %, but one short answer
    assert not m.should_replan()
    m.add(1, 1)  # the running total reaches the minimum
    assert m.should_replan() and m.rate == 1.0


def test_the_running_total_decides_and_replanning_moves_what_was_planned_on():
    m = MeasuredAcceptance(0.6)
    m.add(40, 40)
    m.add(40, 0)  # 40 of 80: 0.5, within the margin of 0.6
    assert m.rate == 0.5 and not m.should_replan()
    m.add(20, 0)  # 40 of 100: 0.4
    assert m.should_replan()
    m.replanned()
    assert m.planned == 0.4 and not m.should_replan()


def test_below_the_planned_rate_also_replans():
    m = MeasuredAcceptance(0.9)
    m.add(32, 8)
    assert m.should_replan()


def test_no_drafted_tokens_no_rate():
    m = MeasuredAcceptance(0.6)
    m.add(0, 0)
    assert m.rate is None and not m.should_replan()


def test_the_replanner_plans_the_mode_again_at_the_measured_rate_and_says_so(smollm2_path, tmp_path):
    from planning import smollm2_profile
    from pipeinfer_cli.planner.auto_choice import AutoChoice
    from pipeinfer_cli.planner.replan import Replanner
    from pipeinfer_cli.decode.draft_spec import DraftSpec
    from pipeinfer_cli.decode.session import DecodeOptions
    from pipeinfer_cli.planner.acceptance import assumed
    from pipeinfer_cli.planner.job_config import JobConfig

    cfg = JobConfig(model_path=smollm2_path, model_label="smollm2", draft_path=None, draft=DraftSpec.parse("lookup"),
                    profile=smollm2_profile(smollm2_path, tmp_path), decode=DecodeOptions(n_predict=24))
    start = DecodeOptions(n_predict=24, n_draft=1, p_accept=0.9, max_inflight=1)
    lines = []
    plan = Replanner(cfg, AutoChoice("pipeinfer", start, None, assumed("test")), 2, lines.append)
    plan.after(8, 8)  # too few drafted tokens yet
    assert lines == [] and plan.decode is start
    plan.after(40, 40)
    assert len(lines) == 1 and lines[0].startswith(
        "pipeinfer: -M auto: measured acceptance 1.00 over 48 drafted tokens (assumed 0.60): re-planned --n-draft ")
    assert plan.decode.n_predict == 24 and plan.decode != start
    assert plan.decode.max_inflight == 1  # the job's KV sequences hold the first choice's runs in flight, no more


def test_the_search_keeps_runs_in_flight_within_a_started_jobs_sequences():
    from pipeinfer_cli.decode.session import DecodeOptions
    from pipeinfer_cli.planner.search import MAX_INFLIGHT, candidate_options

    opts = DecodeOptions()
    free = {o.max_inflight for o in candidate_options("pipeinfer", opts, n_stages=4)}
    assert max(free) == max(f for f in MAX_INFLIGHT if f <= 8) and min(free) == min(MAX_INFLIGHT)
    assert {o.max_inflight for o in candidate_options("pipeinfer", opts, n_stages=4, max_inflight_cap=3)} == \
        {f for f in MAX_INFLIGHT if f <= 3}
    assert {o.max_inflight for o in candidate_options("pipeinfer", opts, n_stages=4, max_inflight_cap=1)} == {1}


def test_a_replanned_chat_prints_iteratives_tokens(smollm2_path, tmp_path):
    """Chat with prompt lookup plans on an assumed 60 %; counting answers measure far from it, so the
    job plans again between turns, and every turn's tokens stay iterative's."""
    import os
    import subprocess
    import sys

    from planning import smollm2_profile

    profile = smollm2_profile(smollm2_path, tmp_path)
    msgs = "Count from 1 to 30, separated by commas.\nAgain, count from 1 to 30, separated by commas.\n"

    def chat(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipeinfer_cli", "chat", str(smollm2_path), "--draft", "lookup",
                               "-M", mode, "--ranks", "2", "--profile", str(profile), "-n", "60"], input=msgs,
                              capture_output=True, text=True, timeout=600, env=dict(os.environ))

    auto, iterative = chat("auto"), chat("iterative")
    assert auto.returncode == 0 and iterative.returncode == 0, auto.stderr + iterative.stderr
    assert "pipeinfer: -M auto chose pipeinfer" in auto.stderr
    assert "pipeinfer: -M auto: measured acceptance " in auto.stderr and "re-planned --n-draft " in auto.stderr
    assert auto.stdout == iterative.stdout


def test_a_server_plans_again_as_it_serves_and_its_answers_stay_iteratives(smollm2_path, tmp_path):
    """serve -M auto with prompt lookup plans on an assumed 60 %; counting answers measure far from
    it, so the server plans again after the requests that ran on auto's settings (saying so on
    stderr), and the answers before and after equal `iterative`'s."""
    from planning import smollm2_profile
    from serving import run_generate, start_server

    profile = smollm2_profile(smollm2_path, tmp_path)
    prompt = "Count from 1 to 30, separated by commas."
    server = start_server(smollm2_path, "--draft", "lookup", "-M", "auto", "--ranks", 2, "--profile", profile,
                          "-n", 60, log_dir=tmp_path)
    try:
        answers = []
        for _ in range(3):
            status, body = server.post_json("/v1/completions", {"prompt": prompt, "max_tokens": 60, "temperature": 0})
            assert status == 200, body
            answers.append(body["choices"][0]["text"])
        deadline = time.monotonic() + 60
        while "re-planned --n-draft " not in server.stderr() and time.monotonic() < deadline:
            time.sleep(0.2)  # the plan is redone on a thread of its own
        log = server.stderr()
    finally:
        server.stop()
    assert "-M auto chose pipeinfer" in log, log
    assert "pipeinfer: -M auto: measured acceptance " in log and "re-planned --n-draft " in log, log
    iterative = run_generate(smollm2_path, "-p", prompt, "-n", 60, "--temp", 0, "-M", "iterative", "--ranks", 2)
    assert answers == [iterative["text"]] * 3

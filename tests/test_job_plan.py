"""A job's plan (planner/job_plan.py), made once before the job starts: the mode, the ranks, the
layout with its threads, the settings, and the choice a launching command hands down; the runtime
only fills in the threads of its hosts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeinfer_cli.decode.draft_spec import DraftSpec
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.errors import UsageError
from pipeinfer_cli.planner.acceptance import Acceptance
from pipeinfer_cli.planner.auto_choice import AutoChoice
from pipeinfer_cli.planner.job_config import JobConfig
from pipeinfer_cli.planner.job_plan import ClusterFacts, PlanRequest, layout_of, make_plan


def config(model, draft: str | None = None, **kw) -> JobConfig:
    spec = DraftSpec.parse(draft)
    return JobConfig(model_path=model, model_label="tiny", draft_path=None, draft=spec, **kw)


def test_the_plan_of_a_job_without_a_draft(tiny_llama):
    plan = make_plan(PlanRequest(config(tiny_llama), None, 2, explicit_ranks=True), ClusterFacts(default_threads=3))
    assert plan.mode == "iterative" and not plan.drafts and not plan.has_draft and plan.auto is None
    assert [(r.role, r.threads) for r in plan.layout.ranks] == [("head", 3), ("stage", 3)]
    assert plan.layout.ranks[0].layers[0] == 0 and plan.layout.ranks[-1].layers[1] == 4
    assert plan.memory is None  # split by bytes: the runtime checks memory as it loads
    # The runtime carries it out with the threads of its hosts, the layers as planned.
    ran = plan.on_hosts(1)
    assert [r.threads for r in ran.ranks] == [1, 1] and [r.layers for r in ran.ranks] == [r.layers for r in plan.layout.ranks]


def test_a_draft_sets_the_default_mode_and_what_the_job_loads(tiny_llama):
    plan = make_plan(PlanRequest(config(tiny_llama, "lookup"), None, 2), ClusterFacts())
    assert plan.mode == "pipeinfer" and plan.drafts and plan.has_draft
    plan = make_plan(PlanRequest(config(tiny_llama, "lookup"), "iterative", 2), ClusterFacts())
    assert plan.mode == "iterative" and not plan.drafts
    # serve and calibrate load the draft whatever the mode; a job without one has none to load.
    assert make_plan(PlanRequest(config(tiny_llama, "lookup"), "iterative", 2, drafts=True), ClusterFacts()).drafts
    assert not make_plan(PlanRequest(config(tiny_llama), None, 2, drafts=True), ClusterFacts()).drafts


def test_threads_as_given_are_the_plan_s_whatever_the_host(tiny_llama):
    plan = make_plan(PlanRequest(config(tiny_llama, threads="2,1"), None, 2), ClusterFacts(default_threads=8))
    assert [r.threads for r in plan.on_hosts(4).ranks] == [2, 1]


def test_a_split_that_cannot_work_fails_when_the_job_is_planned(tiny_llama):
    with pytest.raises(UsageError, match="cannot split 4 layers over 5 ranks"):
        make_plan(PlanRequest(config(tiny_llama), None, 5), ClusterFacts())
    with pytest.raises(UsageError, match="draft rank"):
        make_plan(PlanRequest(config(tiny_llama, layer_split="0.5,0.5/1"), None, 3), ClusterFacts())


def test_a_rank_that_does_not_plan_takes_the_head_s_layout(tiny_llama):
    plan = make_plan(PlanRequest(config(tiny_llama), None, 2), ClusterFacts(on_head=False))
    assert plan.layout is None and plan.mode == "iterative"


def test_the_launching_command_s_choice_is_inherited(tiny_llama):
    """-M auto's choice made by the command that started the job: its mode, settings, threads and
    placement, with no profile read here."""
    cfg = config(tiny_llama, "lookup")
    choice = AutoChoice("speculative", replace(cfg.decode, n_draft=6), 12.5, Acceptance(0.5, True, "prompt"),
                        threads="1", layer_split="3,1")
    said: list[str] = []
    plan = make_plan(PlanRequest(cfg, "auto", 2, inherited=choice), ClusterFacts(), said.append)
    assert plan.mode == "speculative" and plan.auto is choice and plan.cfg.decode.n_draft == 6
    assert plan.cfg.layer_split == "3,1" and plan.cfg.threads == "1"
    assert [r.layers for r in plan.layout.ranks] == [(0, 3), (3, 4)]
    assert said == [choice.announce()]
    # Without a profile here and no choice handed down: the default mode (the head's plan follows).
    plan = make_plan(PlanRequest(cfg, "auto", 2), ClusterFacts(on_head=False))
    assert plan.mode == "pipeinfer" and plan.auto is None


def test_layout_of_is_the_one_the_plan_holds(tiny_llama):
    cfg = config(tiny_llama, "lookup", decode=DecodeOptions(n_draft=3))
    plan = make_plan(PlanRequest(cfg, "speculative", 2), ClusterFacts(default_threads=2))
    assert layout_of(plan.cfg, 2, 2, plan.drafts) == plan.layout

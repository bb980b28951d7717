"""A draft model's acceptance for -M auto: measured by calibrate where the whole target fits, and
with the target a slice of its layers at a time where it does not; never assumed without a word."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

from planning import smollm2_profile
from pipeinfer_cli.decode.draft_spec import DraftSpec
from pipeinfer_cli.planner.profile import DraftCosts, Profile
from pipeinfer_cli.planner.job_config import JobConfig


def _cfg(target, draft) -> JobConfig:
    return JobConfig(model_path=target, model_label="target", draft_path=draft, draft=DraftSpec.parse(str(draft)))


def _with_memory(monkeypatch, available: int) -> None:
    import pipeinfer_cli.runtime.host_facts as hf

    facts = hf.host_facts()
    monkeypatch.setattr(hf, "host_facts", lambda: dataclasses.replace(facts, mem_available_bytes=available))


def test_slices_of_the_target_give_what_the_whole_target_gives(tiny_pair):
    from pipeinfer_cli.cli.draft_acceptance import sliced_agreement

    target, _ = tiny_pair
    full = [5, 9, 14, 3, 22, 7, 11, 30, 2, 8]
    probs = [0.5] * 6
    whole = sliced_agreement(target, [(0, 6)], full, 4, probs, 32, 1)
    pieces = sliced_agreement(target, [(0, 2), (2, 4), (4, 6)], full, 4, probs, 32, 1)
    assert whole == pieces and len(whole[0]) + len(whole[1]) == 6


def test_a_target_that_does_not_fit_whole_is_measured_in_slices(tiny_pair, monkeypatch):
    from pipeinfer_cli.cli.draft_acceptance import MEMORY_USE, measure_draft_acceptance

    target, draft = tiny_pair
    # Room for the draft and a few of the target's layers at a time, not for the whole target.
    _with_memory(monkeypatch, int((draft.stat().st_size + target.stat().st_size) / 2 / MEMORY_USE))
    said = []
    d = DraftCosts("model", "draft", 0, 1, 1e-3, 1e-4)
    measure_draft_acceptance(_cfg(target, draft), d, 12, said.append)
    assert any("slices of its layers" in line for line in said), said
    assert d.acceptance is not None and d.acceptance_tokens > 0 and d.acceptance_note is None
    assert len(d.confidence_right) + len(d.confidence_wrong) == d.acceptance_tokens


def test_where_nothing_fits_calibrate_says_why_and_auto_repeats_it(tiny_pair, monkeypatch):
    from pipeinfer_cli.planner.auto_choice import draft_acceptance
    from pipeinfer_cli.cli.draft_acceptance import measure_draft_acceptance

    target, draft = tiny_pair
    _with_memory(monkeypatch, draft.stat().st_size // 2)
    said = []
    d = DraftCosts("model", "draft", 0, 1, 1e-3, 1e-4)
    measure_draft_acceptance(_cfg(target, draft), d, 12, said.append)
    assert d.acceptance is None and "fits in 80% of this host's available memory" in d.acceptance_note
    assert said == [f"draft acceptance not measured: {d.acceptance_note} (-M auto will assume it, and say so)"]
    acc = draft_acceptance(_cfg(target, draft), SimpleNamespace(draft=d), None)
    assert not acc.measured and d.acceptance_note in acc.source


def test_auto_says_on_stderr_that_it_assumes_the_acceptance(smollm2_path, tmp_path):
    prof_path = smollm2_profile(smollm2_path, tmp_path)
    prof = Profile.load(prof_path)
    prof.draft.acceptance_note = "the target and the draft do not fit"
    prof.save(prof_path)
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--draft",
                        str(smollm2_path), "-M", "auto", "--profile", str(prof_path), "-p", "Hi", "-n", "2"],
                       capture_output=True, text=True, timeout=600, env=os.environ)
    assert r.returncode == 0, r.stderr
    warn = [x for x in r.stderr.splitlines() if x.startswith("pipeinfer: -M auto: warning: planning on an assumed")]
    assert len(warn) == 1 and "60%" in warn[0] and "the target and the draft do not fit" in warn[0], r.stderr


def test_acceptance_is_measured_after_a_chat_request_where_the_target_has_a_template(smollm2_path):
    from pipeinfer_cli.cli.draft_acceptance import CALIBRATION_REQUEST, CALIBRATION_TEXT, calibration_prompt
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    try:
        prompt, what = calibration_prompt(tok)
        assert prompt == tok.chat_messages([{"role": "user", "content": CALIBRATION_REQUEST}]) and "chat" in what
        assert prompt != tok.encode(CALIBRATION_TEXT)
    finally:
        tok.close()
    # A target without a template: the raw text.
    from pipeinfer_cli.runtime.tokenizer import NoChatTemplateError

    class NoTemplate:
        def chat_messages(self, messages):
            raise NoChatTemplateError()

        def encode(self, text):
            return [len(text)]

    assert calibration_prompt(NoTemplate()) == ([len(CALIBRATION_TEXT)], "a calibration prompt (the target has no chat template)")

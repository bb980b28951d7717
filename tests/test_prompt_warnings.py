"""A prompt with control characters (NUL bytes from a binary file, escape sequences from a terminal
capture) still runs, but one `Warning:` line on stderr says so, once, also for a 2-rank job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeinfer_cli.cli.prompt_input import control_character_warning


@pytest.mark.parametrize("text", ["plain", "two\nlines\tand a tab\r\n", "ünïcödé — “quotes” \u200b"])
def test_text_controls_are_fine(text):
    assert control_character_warning([(text, "")]) is None


def test_the_warning_counts_them_and_names_the_first():
    w = control_character_warning([("ok\n", "in message 0 (system), "), ("a\x1b[31mred\x00", "in message 1 (user), ")])
    assert w == ("Warning: the prompt holds 2 control characters other than newline and tab (the first, U+001B, "
                 "in message 1 (user), at character 1); the model reads them as text, so check that this is the "
                 "input you meant")
    assert "holds 1 control character " in control_character_warning([("\x7f", "")])


def _generate(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", *map(str, args), "-n", "2",
                           "--threads", "1", "--json"], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ranks", [1, 2])
def test_nul_bytes_warn_once_and_still_run(smollm2_path, tmp_path, ranks):
    nul = tmp_path / "nul.bin"
    nul.write_bytes(b"\0" * 2000)
    r = _generate(smollm2_path, "-f", nul, "--ranks", ranks, "--ctx", 4096)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "Warning: the prompt holds 2000 control characters other than newline and tab (the first, U+0000, at "
        "character 0); the model reads them as text, so check that this is the input you meant"], r.stderr
    assert json.loads(r.stdout)["n_gen"] >= 1


def test_a_clean_chat_prompt_gives_no_warning(smollm2_path):
    r = _generate(smollm2_path, "--chat", "Say hi.\tThen stop.\n")
    assert r.returncode == 0 and r.stderr == "", r.stderr

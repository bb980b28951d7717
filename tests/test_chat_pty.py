"""`pipeinfer chat` in a pseudo-terminal, as a user runs it: two turns (the second reusing the first
turn's KV cells), /exit, Ctrl-D, odd input, and nothing of the job left running afterwards."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from jobprocs import assert_no_survivors, job_env

pexpect = pytest.importorskip("pexpect")
pytestmark = pytest.mark.mpi

PIPEINFER = str(Path(sys.executable).with_name("pipeinfer"))
LONG = "Here is a list. " + " ".join(f"Item {i}: the {w} fox jumps over the lazy dog." for i, w in
                                      enumerate(["quick", "brown", "red", "slow", "grey", "small"] * 7))
SUMMARY = r"pipeinfer: \d+ tokens?, .*reused (\d+)/(\d+) prompt tokens, mode (\w+), 2 ranks[^\r\n]*\r\n"


def spawn(model, *args: str):
    import uuid

    marker = uuid.uuid4().hex
    child = pexpect.spawn(PIPEINFER, ["chat", str(model), "--ranks", "2", "-n", "16", *args], encoding="utf-8",
                          timeout=300, env=job_env(marker), dimensions=(40, 200))
    child.expect_exact("/exit or Ctrl-D ends.")
    child.expect_exact("> ")
    return child, marker


def turn(child, text: str) -> tuple[str, int, int]:
    """Send a message; the answer and the (reused, prompt) token counts of its summary line."""
    child.sendline(text)
    child.expect_exact(text + "\r\n")  # the terminal's echo
    child.expect(SUMMARY)
    answer, reused, n_prompt = child.before, int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact("> ")
    return answer.strip(), reused, n_prompt


def test_two_turns_then_exit(smollm2_path):
    child, marker = spawn(smollm2_path, "--draft", "lookup")
    first, reused1, n1 = turn(child, LONG)
    assert first and reused1 == 0 and n1 > 256
    second, reused2, n2 = turn(child, "Which colours did I list?")
    assert second and n2 > n1 and reused2 >= 256  # the first turn's whole prompt chunks were kept
    # Odd input: an unknown command and a blank line are handled without ending the chat.
    child.sendline("/frobnicate")
    child.expect_exact("Error: unknown command /frobnicate")
    child.expect_exact("> ")
    child.sendline("")
    child.expect_exact("> ")
    child.sendline("/reset")
    child.expect_exact("new conversation")
    child.expect_exact("> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in child.before
    assert_no_survivors(marker)


def test_ctrl_d_ends_the_chat_cleanly(smollm2_path):
    child, marker = spawn(smollm2_path)
    child.sendeof()
    child.expect(pexpect.EOF)
    rest = child.before
    child.close()
    assert child.exitstatus == 0, rest
    assert not re.search(r"Error|Traceback", rest), rest
    assert_no_survivors(marker)

"""The interactive loop of `pipeinfer chat`, on the head: read a line, answer it, keep the history.

Each turn sends the whole conversation through the model's chat template; the engine keeps the
previous turn's KV cells and reuses the prefix it may (`decode/prefix_cache.py`), so a turn pays
mostly for what is new. Lines starting with '/' are commands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO, TextIO

from ..decode.result import GenerationResult
from ..errors import UsageError, error_line

HELP = "commands: /reset (new conversation), /exit (or Ctrl-D), /help"


@dataclass
class ChatSettings:
    """What every turn of a chat shares."""

    mode: str  # decoding mode of every turn
    system: str | None = None  # system prompt, kept across /reset
    stop: list[str] = field(default_factory=list)  # stop strings
    show_prompt: bool = True  # print "> " (stderr) before reading a line (standard input is a terminal)
    replanner: object | None = None  # -M auto's Replanner (planner/replan.py): each turn's settings, planned again


class ChatSession:
    """One chat on a loaded job (`runtime.head.Head`): history, commands, streaming, summaries."""

    def __init__(self, head, settings: ChatSettings, summary: Callable[[GenerationResult], str],
                 stdin: BinaryIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None):
        """stdout: the answers; stderr: prompts, summaries, notes and errors. When both are the same
        terminal, pass the same stream twice: under mpiexec stdout and stderr reach the terminal
        through separate pipes, and only one stream keeps a summary after the answer it is about."""
        self.head, self.settings, self.summary = head, settings, summary
        self.stdin = stdin or sys.stdin.buffer
        self.stdout, self.stderr = stdout or sys.stdout, stderr or sys.stderr
        self.history: list[dict] = self._fresh_history()

    def _fresh_history(self) -> list[dict]:
        return [{"role": "system", "content": self.settings.system}] if self.settings.system else []

    def run(self) -> None:
        """Until /exit or the end of standard input."""
        while (line := self._read_line()) is not None:
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self._command(text):
                    return
                continue
            self.turn(line)

    def _read_line(self) -> str | None:
        """The next line of input (without its newline), None at the end of input. A line that is
        not valid UTF-8 is refused with an error and skipped."""
        while True:
            if self.settings.show_prompt:
                self.stderr.write("> ")
                self.stderr.flush()
            data = self.stdin.readline()
            if not data:
                if self.settings.show_prompt:
                    self.stderr.write("\n")  # Ctrl-D leaves the cursor after the prompt
                    self.stderr.flush()
                return None
            try:
                return data.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                self._error(f"that line is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                            "type it again")

    def _command(self, text: str) -> bool:
        """Run a /command; False if the chat ends."""
        word = text.split()[0].lower()
        if word in ("/exit", "/quit"):
            return False
        if word == "/reset":
            self.history = self._fresh_history()
            self.head.reset()
            self._note("new conversation (history and KV caches cleared)")
        elif word == "/help":
            self._note(HELP)
        else:
            self._error(f"unknown command {word}; {HELP}")
        return True

    def turn(self, user_text: str) -> GenerationResult | None:
        """Answer one user message, streaming the text; its result, or None if it was refused."""
        from ..runtime.head import Callbacks
        from ..runtime.job import Request
        from ..runtime.loading import PromptTooLongError

        messages = self.history + [{"role": "user", "content": user_text}]
        plan = self.settings.replanner
        req = Request(mode=self.settings.mode, chat=messages, stop=list(self.settings.stop),
                      decode=plan.decode if plan is not None else None)
        try:
            prompt = self.head.tokenize(req)
        except PromptTooLongError as e:
            self._error(f"with this message the conversation has {e.n_prompt} tokens, and with the answer it needs "
                        f"{e.need} KV cells, more than --ctx {e.n_ctx}; /reset starts a new conversation "
                        "(or restart the chat with a larger --ctx, or a lower -n)")
            return None
        except UsageError as e:
            self._error(str(e))
            return None
        result = self.head.run(req, prompt, Callbacks(on_text=self._write))
        self.stdout.write("\n")
        self.stdout.flush()
        self.history = messages + [{"role": "assistant", "content": result.text}]
        self._note(self.summary(result))
        if plan is not None:
            plan.after(result.acceptance.drafted, result.acceptance.accepted)
        return result

    def _write(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def _note(self, text: str) -> None:
        self.stderr.write(text + "\n")
        self.stderr.flush()

    def _error(self, msg: str) -> None:
        self._note(error_line(msg))

"""Where the prompt comes from: -p text, -f file (or '-' for standard input), --chat message,
--messages JSON file, with an optional --system prompt. Checked before any model is loaded."""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .wording import plural

ROLES = ("system", "user", "assistant")
TEXT_CONTROLS = "\n\t\r"  # the control characters that text holds; any other one is worth a warning


@dataclass
class PromptInput:
    text: str | None = None  # raw prompt, tokenized as is
    messages: list[dict] | None = None  # chat messages, formatted with the model's chat template
    stdin_text: str | None = None  # what was read from standard input ('-f -' or '--messages -')


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{where} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it first, e.g. `iconv -f latin1 -t utf-8`"
        ) from None


def _argument_text(text: str, option: str) -> str:
    """Command-line text: invalid UTF-8 in argv arrives as lone surrogates (surrogateescape)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _utf8(text.encode("utf-8", "surrogateescape"), f"the text of {option}")


_stdin_cache: list[str] = []


def _read(path: Path, option: str) -> str:
    if str(path) == "-":
        if not _stdin_cache:
            _stdin_cache.append(_utf8(sys.stdin.buffer.read(), "standard input"))
        return _stdin_cache[0]
    try:
        return _utf8(path.read_bytes(), str(path))
    except OSError as e:
        raise UsageError(f"cannot read the {option} file {path}: {e.strerror}") from None


def _load_messages(path: Path) -> list[dict]:
    text = _read(path, "--messages")
    path = "standard input" if str(path) == "-" else path  # for the messages below
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not data:
        raise UsageError(f"{path} must hold a non-empty JSON list of messages "
                         '[{"role": "user", "content": "..."}] (or an object with a "messages" list)')
    for i, m in enumerate(data):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UsageError(f'{path}: message {i} must be an object with string "role" and "content"')
        if m["role"] not in ROLES:
            raise UsageError(f"{path}: message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in data]


def check_stop_strings(stop: list[str] | None) -> list[str]:
    """--stop values: non-empty, valid UTF-8."""
    out = []
    for s in stop or []:
        if s == "":
            raise UsageError("--stop needs some text (an empty stop string would stop at once)")
        out.append(_argument_text(s, "--stop"))
    return out


def read_prompt_input(prompt: str | None, file: Path | None, chat: str | None, messages: Path | None,
                      system: str | None) -> PromptInput:
    given = [name for name, v in (("-p/--prompt", prompt), ("-f/--file", file), ("--chat", chat),
                                  ("--messages", messages)) if v is not None]
    if len(given) != 1:
        also = f" (got {' and '.join(given)})" if given else ""
        raise UsageError(f"give exactly one of -p/--prompt, -f/--file, --chat or --messages{also}")
    if system is not None and prompt is None and file is None:
        system = _argument_text(system, "--system")
    elif system is not None:
        raise UsageError("--system needs --chat or --messages (a raw -p/-f prompt has no roles)")
    if prompt is not None:
        out = PromptInput(text=_argument_text(prompt, "-p/--prompt"))
    elif file is not None:
        out = PromptInput(text=_read(file, "prompt"))
    elif chat is not None:
        out = PromptInput(messages=[{"role": "user", "content": _argument_text(chat, "--chat")}])
    else:
        out = PromptInput(messages=_load_messages(messages))
    if out.text == "" or (out.messages is not None and all(m["content"] == "" for m in out.messages)):
        src = {"-p/--prompt": "-p", "-f/--file": f"the file {file}", "--chat": "--chat",
               "--messages": f"{messages}"}[given[0]]
        raise UsageError(f"the prompt is empty ({src}); give some text")
    if _stdin_cache and any(v is not None and str(v) == "-" for v in (file, messages)):
        out.stdin_text = _stdin_cache[0]
    if system is not None:
        if any(m["role"] == "system" for m in out.messages):
            raise UsageError("--system given, but the messages already have a system message; keep one")
        out.messages.insert(0, {"role": "system", "content": system})
    _warn_control_characters(out)
    return out


def control_character_warning(parts: list[tuple[str, str]]) -> str | None:
    """The warning for a prompt that holds control characters other than newline, tab and carriage
    return (NUL bytes, escape sequences: a binary file, a terminal capture), or None. The model
    reads them as tokens like any other, so such a prompt runs, but rarely as the user meant.
    parts: (text, where it is: "" for a raw prompt, "in message 2 (user), ") for each part of the prompt."""
    found = [(where, i, c) for text, where in parts for i, c in enumerate(text)
             if c not in TEXT_CONTROLS and unicodedata.category(c) == "Cc"]
    if not found:
        return None
    where, i, c = found[0]
    return (f"Warning: the prompt holds {plural(len(found), 'control character')} other than newline and tab "
            f"(the first, U+{ord(c):04X}, {where}at character {i}); the model reads them as text, so check that "
            "this is the input you meant")


def _warn_control_characters(given: PromptInput) -> None:
    """One warning line on stderr, from the process that read the prompt (a job relaunched under
    mpiexec reads it again: the command that started it has warned already)."""
    from ..transport.launch import RELAUNCHED
    from .console import err

    if os.environ.get(RELAUNCHED):
        return
    if given.text is not None:
        parts = [(given.text, "")]
    else:
        parts = [(m["content"], f"in message {k} ({m['role']}), ") for k, m in enumerate(given.messages)]
    warning = control_character_warning(parts)
    if warning is not None:
        err.print(warning, markup=False, highlight=False)

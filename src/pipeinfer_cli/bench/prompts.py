"""Benchmark prompt sets: JSONL, one object per line with an `id` and either `prompt` or `messages`.

    {"id": "story", "prompt": "Once upon a time"}                          raw text, no template
    {"id": "fizz", "messages": [{"role": "user", "content": "FizzBuzz"}]}  chat, model's template

Blank lines and lines starting with `#` are skipped. Everything is validated before any model is
loaded, and an error names the file, the line and the fix.

Two sets ship with the package, selected by name (`--prompts grounded`): `default`, short coding
and prose requests whose answers are new text, and `grounded`, tasks whose answer copies much of
a 400-550-token prompt (edit, fix, convert, document code; answer from a given document), where
drafting by prompt lookup should be right most of the time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import UsageError

DEFAULT_PROMPTS = "default.jsonl"  # shipped in pipeinfer_cli/bench/prompts/
SHIPPED_SETS = {"default": "default.jsonl", "grounded": "grounded.jsonl"}  # name -> file in that folder
CHAT_ROLES = ("system", "user", "assistant")


class PromptFileError(UsageError):
    """A prompt file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # unique within the set; the `prompt_id` of every record
    prompt: str | None = None  # raw text
    messages: tuple[dict, ...] | None = None  # chat messages, formatted with the model's chat template

    @property
    def kind(self) -> str:
        return "raw" if self.prompt is not None else "chat"


def default_prompts_path() -> Path:
    return shipped_prompts_path("default")


def shipped_prompts_path(name: str) -> Path:
    return Path(str(resources.files("pipeinfer_cli.bench") / "prompts" / SHIPPED_SETS[name]))


def resolve_prompts(spec: str | Path | None) -> Path | None:
    """The file a --prompts value names: None (the default set), a shipped set's name, or a path.

    A file of that name in the current directory wins over a shipped set (it is what a user who
    typed it meant); names stay simple words, so the two rarely meet.
    """
    if spec is None:
        return None
    text = str(spec)
    if text in SHIPPED_SETS and not Path(text).is_file():
        return shipped_prompts_path(text)
    return Path(text)


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Read and validate a prompt set (the shipped default when path is None, a shipped set by name,
    or a JSONL file); first `limit` prompts."""
    path = resolve_prompts(path) or default_prompts_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"prompt file {path} does not exist; pass a JSONL file to --prompts, a shipped set "
                              f"({', '.join(SHIPPED_SETS)}), or omit it for the default set") from None
    except IsADirectoryError:
        raise PromptFileError(f"prompt file {path} is a directory; pass a JSONL file to --prompts") from None
    except UnicodeDecodeError:
        raise PromptFileError(f"prompt file {path} is not UTF-8 text; pass a JSONL file to --prompts") from None
    except OSError as e:
        raise PromptFileError(f"cannot read the prompt file {path}: {e.strerror}") from None
    prompts = parse_prompts(text, str(path))
    return prompts[:limit] if limit else prompts


def parse_prompts(text: str, where: str = "<prompts>") -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        at = f"{where}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{at}: not valid JSON ({e.msg}); each line must be one object such as "
                                  '{"id": "x", "prompt": "..."}') from None
        p = _parse_one(obj, at, default_id=f"line-{n}")
        if p.id in seen:
            raise PromptFileError(f"{at}: duplicate id {p.id!r} (first on line {seen[p.id]}); ids must be unique")
        seen[p.id] = n
        prompts.append(p)
    if not prompts:
        raise PromptFileError(f"{where}: no prompts; add one JSON object per line with an id and a prompt or messages")
    return prompts


def _parse_one(obj, at: str, default_id: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise PromptFileError(f"{at}: expected a JSON object with an id and a prompt or messages, got {type(obj).__name__}")
    pid = obj.get("id", default_id)
    if not isinstance(pid, str | int) or isinstance(pid, bool) or str(pid) == "":
        raise PromptFileError(f"{at}: id must be a non-empty string, got {pid!r}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise PromptFileError(f"{at}: give exactly one of \"prompt\" (raw text) or \"messages\" (chat), not "
                              f"{'both' if has_prompt else 'neither'}")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise PromptFileError(f"{at}: \"prompt\" must be a non-empty string")
        return BenchPrompt(str(pid), prompt=obj["prompt"])
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise PromptFileError(f"{at}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in CHAT_ROLES:
            raise PromptFileError(f"{at}: messages[{i}] must be an object with a role ({', '.join(CHAT_ROLES)}) "
                                  f"and a string content")
    return BenchPrompt(str(pid), messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs))

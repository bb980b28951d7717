"""OpenAI request bodies → what the service runs. Every field is checked; a refusal names it.

Fields the server does not support get a 400 that says what is supported, rather than being
silently ignored (a client asking for n=3 or logprobs must not believe it got them). Fields with
no effect on the generated text (user, metadata, store, …) and unknown fields are ignored, as
llama-server does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..decode.sampling import SamplingParams
from ..decode.modes import MODE_NAMES as MODES
from .openai_errors import ApiError, invalid, unsupported

MAX_STOP_STRINGS = 16
ROLES = ("system", "user", "assistant")


@dataclass
class ParsedRequest:
    """A checked request: the prompt (chat messages, raw text or token ids) and how to generate."""

    chat: bool
    messages: list[dict] | None = None  # chat: [{"role", "content"}] with string contents
    prompt: str | list[int] | None = None  # completions: text or token ids
    model: str | None = None
    max_tokens: int | None = None  # None: the server's -n
    max_tokens_field: str = "max_tokens"  # the field the client used (for error messages)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    mode: str | None = None
    speculative: dict | None = None  # llama-server's speculative.n_max / n_min / p_min, given ones only
    stream: bool = False
    include_usage: bool = False

    def sampling(self, default: SamplingParams) -> SamplingParams:
        """The request's sampling: its own fields, the server's settings for the others."""
        return SamplingParams(
            temperature=default.temperature if self.temperature is None else self.temperature,
            top_k=default.top_k if self.top_k is None else self.top_k,
            top_p=default.top_p if self.top_p is None else self.top_p,
            min_p=default.min_p if self.min_p is None else self.min_p,
            seed=default.seed if self.seed is None else self.seed,
        )


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON ({e}); send a JSON object", "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, not {type(body).__name__}", "invalid_json")
    return body


def parse_chat(body: dict) -> ParsedRequest:
    req = ParsedRequest(chat=True, messages=_messages(body.get("messages")))
    _common(body, req)
    return req


def parse_completion(body: dict) -> ParsedRequest:
    req = ParsedRequest(chat=False, prompt=_prompt(body.get("prompt")))
    for name in ("suffix",):
        if body.get(name) not in (None, ""):
            raise unsupported(name, "is not supported; put all the text in prompt")
    if body.get("echo"):
        raise unsupported("echo", "is not supported (only echo=false)")
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    _common(body, req)
    return req


def _common(body: dict, req: ParsedRequest) -> None:
    """The fields chat and completions share."""
    _refuse_unsupported(body)
    req.model = _typed(body, "model", str)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        req.max_tokens, req.max_tokens_field = _int(body, "max_completion_tokens", lo=1), "max_completion_tokens"
    else:
        req.max_tokens = _int(body, "max_tokens", lo=1)
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0)
    req.min_p = _number(body, "min_p", 0.0, 1.0)
    req.top_k = _int(body, "top_k", lo=0)
    req.seed = _int(body, "seed")
    req.stop = _stop(body.get("stop"))
    req.stream = bool(_typed(body, "stream", bool))
    options = _typed(body, "stream_options", dict) or {}
    req.include_usage = bool(options.get("include_usage"))
    mode = _typed(body, "mode", str)
    if mode is not None and mode not in MODES:
        raise invalid("mode", f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    req.mode = mode
    req.speculative = _speculative(body)
    n = _int(body, "n", lo=1)
    if n not in (None, 1):
        raise unsupported("n", f"only n=1 is supported (got {n}); send one request per completion")


MAX_DRAFT = 64  # as --n-draft


def _speculative(body: dict) -> dict | None:
    """llama-server's per-request draft settings, as flat keys ("speculative.n_max": 8) or an
    object ("speculative": {"n_max": 8}): n_max draft tokens per run at most, n_min at least (a
    shorter draft is not verified), p_min the draft's confidence below which drafting stops."""
    nested = _typed(body, "speculative", dict) or {}
    flat = {f"speculative.{k}": v for k, v in nested.items()}
    flat.update({k: v for k, v in body.items() if k.startswith("speculative.")})
    unknown = sorted(k for k in flat if k not in ("speculative.n_max", "speculative.n_min", "speculative.p_min"))
    if unknown:
        raise unsupported(unknown[0], "is not a setting; use speculative.n_max, speculative.n_min or speculative.p_min")
    out = {}
    for key, lo in (("n_max", 1), ("n_min", 0)):
        value = _int(flat, f"speculative.{key}", lo=lo)
        if value is not None and value > MAX_DRAFT:
            raise invalid(f"speculative.{key}", f"speculative.{key} must be <= {MAX_DRAFT} (got {value})")
        if value is not None:
            out[key] = value
    p_min = _number(flat, "speculative.p_min", 0.0, 1.0)
    if p_min is not None:
        out["p_min"] = p_min
    return out or None


def _refuse_unsupported(body: dict) -> None:
    if body.get("logprobs") not in (None, False, 0):
        raise unsupported("logprobs", "log probabilities are not supported; leave logprobs unset or false")
    if body.get("top_logprobs") not in (None, 0):
        raise unsupported("top_logprobs", "log probabilities are not supported")
    for name in ("tools", "functions"):
        if body.get(name):
            raise unsupported(name, "tool and function calling are not supported")
    if body.get("tool_choice") not in (None, "none"):
        raise unsupported("tool_choice", "tool calling is not supported; only tool_choice='none'")
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", "function calling is not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise unsupported("response_format", "only {\"type\": \"text\"} is supported")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise unsupported(name, "repetition penalties are not supported (only 0)")


def _typed(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise invalid(name, f"{name} must be {_kind_name(kind)}, not {_json_kind(value)}", "invalid_type")
    return value


def _int(body: dict, name: str, lo: int | None = None) -> int | None:
    value = _typed(body, name, int)
    if value is not None and lo is not None and value < lo:
        raise invalid(name, f"{name} must be >= {lo} (got {value})")
    return value


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, f"{name} must be a number, not {_json_kind(value)}", "invalid_type")
    if not lo <= value <= hi:
        raise invalid(name, f"{name} must be between {lo:g} and {hi:g} (got {value})")
    return float(value)


def _stop(value) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(items)})")
    return [s for s in items if s]


def _messages(value) -> list[dict]:
    if value is None:
        raise invalid("messages", "messages is required: a list of {\"role\", \"content\"} objects", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects", "invalid_type")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"{where} must be an object with role and content", "invalid_type")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)} (got {role!r}); "
                                           "tool messages are not supported")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(value, where: str) -> str:
    """A message's text: a string, or a list of text parts (other parts are refused)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(where, "only text content is supported (a string, or parts of type \"text\")")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, f"{where} must be a string (or a list of text parts), not {_json_kind(value)}", "invalid_type")


def _prompt(value) -> str | list[int]:
    if value is None:
        raise invalid("prompt", "prompt is required: a string (or a list of token ids)", "missing_required_parameter")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise unsupported("prompt", "one prompt per request is supported, not a batch of prompts")
    raise invalid("prompt", "prompt must be a string or a list of token ids", "invalid_type")


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "an integer", bool: "true or false", dict: "an object", float: "a number"}[kind]


def _json_kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), "null" if value is None else type(value).__name__)


def check_tokens(prompt: list[int], n_vocab: int) -> None:
    bad = [t for t in prompt if not 0 <= t < n_vocab]
    if bad:
        raise ApiError(400, f"prompt: token id {bad[0]} is out of the vocabulary (0..{n_vocab - 1})", param="prompt",
                       code="invalid_value")

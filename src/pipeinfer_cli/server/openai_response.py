"""Results → OpenAI response objects and stream chunks, with llama-server-style `timings`.

`timings` has llama-server's fields (prompt_n, prompt_ms, predicted_n, predicted_ms, …) and what
only pipeinfer has: the mode, the draft's acceptance, the runs launched and cancelled, TTFT and
the time spent in the queue. `pipeinfer` (extension) gives the token ids, the request's number
(submission order) and run index (the order the pipeline took requests), and each rank's KV cells
in use at the end of the request, before the caches are cleared for the next one.
"""

from __future__ import annotations

import time
import uuid

from ..decode.result import GenerationResult


class Reply:
    """The identity shared by a response and all its chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "pipeinfer"}

    def _choice(self, text: str | None, finish_reason: str | None, stream: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if stream:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def complete(self, result: GenerationResult) -> dict:
        """The non-streaming response."""
        return {**self._base(self.object), "choices": [self._choice(result.text, finish_reason(result), False)],
                "usage": usage(result), "timings": timings(result), "pipeinfer": extension(result)}

    def chunk(self, text: str, first: bool = False) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [self._choice(text, None, True, first)]}

    def last_chunk(self, result: GenerationResult, with_usage: bool) -> dict:
        """The chunk that carries finish_reason (and timings, as llama-server sends them)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._base(obj), "choices": [self._choice("", finish_reason(result), True)],
               "timings": timings(result), "pipeinfer": extension(result)}
        if with_usage:
            out["usage"] = None  # OpenAI: usage comes in a chunk of its own, after this one
        return out

    def usage_chunk(self, result: GenerationResult) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(result)}


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.n_prompt, "completion_tokens": result.n_gen,
            "total_tokens": result.n_prompt + result.n_gen}


def timings(result: GenerationResult) -> dict:
    n_prompt, n_gen = result.n_prompt, result.n_gen
    ttft = result.ttft_s
    total = n_gen / result.tok_per_s if result.tok_per_s else None
    prompt_ms = ttft * 1e3 if ttft is not None else None
    predicted_ms = (total - ttft) * 1e3 if total is not None and ttft is not None else None
    acc, runs = result.acceptance, result.runs
    return {
        # llama-server's name for the prompt tokens taken from the KV cache instead of recomputed
        "cache_n": result.reused_tokens,
        "prompt_n": n_prompt, "prompt_ms": _r(prompt_ms),
        "prompt_per_token_ms": _r(prompt_ms / n_prompt if prompt_ms is not None and n_prompt else None),
        "prompt_per_second": _r(n_prompt / ttft if ttft else None),
        "predicted_n": n_gen, "predicted_ms": _r(predicted_ms),
        "predicted_per_token_ms": _r(predicted_ms / (n_gen - 1) if predicted_ms and n_gen > 1 else None),
        "predicted_per_second": _r(result.decode_tok_per_s),
        # pipeinfer's own
        "mode": result.mode, "ttft_ms": _r(prompt_ms),
        "reused_tokens": result.reused_tokens,
        "common_prefix_tokens": result.common_prefix_tokens,
        "queue_ms": _r(result.queue_s * 1e3 if result.queue_s is not None else None),
        "tok_per_s": _r(result.tok_per_s),
        "draft_n": acc.drafted, "draft_n_accepted": acc.accepted,
        "acceptance_rate": _r(acc.rate, 4), "mean_accepted_len": _r(acc.mean_accepted_len, 3),
        # per draft source of a hybrid draft (lookup+MODEL): {"lookup": {"drafted", "accepted", "rate"}, ...}
        "draft_by_source": acc.to_dict().get("by_source", {}),
        "runs_launched": runs.launched, "runs_speculative": runs.speculative,
        "runs_cancelled": runs.cancelled,
        "drafting_paused": runs.drafting_paused, "drafting_ended": runs.drafting_ended,
    }


def extension(result: GenerationResult) -> dict:
    return {"mode": result.mode, "draft": result.draft, "tokens": result.tokens,
            "request": result.request_seq, "run_index": result.run_index, "slot": result.slot,
            "kv_used_cells": result.kv_used_cells()}


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)

"""Drafters propose continuations of a token path. All share one small interface.

`propose(path, n_max, p_min)` returns up to n_max (token, probability) pairs that continue
`path` (the committed tokens plus any tokens already in flight), stopping early when the
drafter's confidence falls under p_min. A drafter keeps whatever state helps it (the GGUF
draft keeps its KV cache for the longest prefix it shares with the new path).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .cpu_account import DRAFT, PROCESS
from .prefix_cache import PrefixCache
from .sampling import softmax_top
from .session import chunk_floor, prefill_chunks


@dataclass
class Proposal:
    tokens: list[int]
    probs: list[float]  # drafter's confidence in each token
    # Per position, the runner-up candidates (token, p) the drafter saw; used to split token trees.
    alternatives: list[list[tuple[int, float]]]
    base: list[int] | None = None  # the path it continues (set by asynchronous drafters)
    source: str | None = None  # which drafter of a hybrid proposed it ("lookup", "suffix" or "model"); None otherwise


class Drafter(Protocol):
    name: str
    # Reading the prompt (`start`) computes on this process's cores: a draft model here. The head
    # counts its thread and may defer that pass (draft_economy.py); lookup and a draft rank's proxy
    # have none.
    has_prompt_pass: bool
    kv_tokens: list[int]  # the tokens whose KV the drafter's own context holds ([] without one)

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        """Begin a request with this prompt. reuse: leading prompt tokens whose cells the target
        keeps from the previous request (prefix reuse; 0 = start afresh)."""
        ...

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncDrafter(Protocol):
    """A drafter that answers asynchronously: a draft rank's head-side proxy (`RemoteDrafter`).

    pipeinfer mode drafts ahead with it instead of `propose`: `request` sends a path to continue,
    `poll` returns the reply once it has arrived (with `Proposal.base` = that path), and at most one
    request is outstanding, so a reply always answers the last request. The proxy is a `Drafter`
    too (`start`, `propose`, `close`), for prefill and speculative mode; those are not repeated
    here, so that `isinstance(d, AsyncDrafter)` tells the asynchronous ones apart by what
    pipeinfer mode calls.
    """

    @property
    def outstanding(self) -> bool:
        """A request was sent and its reply not received yet."""
        ...

    def request(self, path: list[int], n_max: int, p_min: float) -> None: ...

    def ready(self) -> bool:
        """The outstanding request's reply has arrived (not received yet)."""
        ...

    def poll(self, whole: bool = False) -> Proposal | None:
        """The reply, if it has arrived (without waiting). A draft rank streams its tokens: the
        reply may come with the first token past the path; whole: only with all n_max of them (or
        the end of the draft)."""
        ...

    def wait(self, whole: bool = False) -> Proposal | None:
        """Wait (without spinning) for the outstanding request's reply, if any (whole: see poll)."""
        ...

    def end_stream(self) -> None:
        """The end of a request: the drafter stops drafting ahead for it."""
        ...


def continues(base: list[int], drafted: list[int], path: list[int], may_grow: bool = False) -> bool:
    """Whether a draft stream (tokens `drafted` after `base`) continues `path`: path agrees with
    what it drafted and it has a token beyond path, or may_grow (it may still draft one)."""
    have = base + drafted
    n = min(len(path), len(have))
    if len(path) < len(base) or have[:n] != path[:n]:
        return False
    return len(have) > len(path) or may_grow


class LlamaDrafter:
    """A GGUF draft model run by llama.cpp (llama-cpp-python's low-level API) on this rank.

    Its prompt pass and proposals are charged to this process's CPU account as DRAFT (cpu_account.py)."""

    name = "model"
    has_prompt_pass = True  # it must read the prompt before it can draft (`start`)

    def __init__(self, path: Path, n_ctx: int, n_threads: int, n_alternatives: int = 4):
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr

        from ..native import ggml_cpu

        ggml_cpu()  # llama.cpp computes with the CPU backend registered; a per-variant ggml has none yet
        self.lib = llama_cpp
        with suppress_stdout_stderr(disable=False):
            self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=n_threads,
                                       n_threads_batch=n_threads, verbose=False)
        self.ctx = self.llm.ctx
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = self.llm.n_vocab()
        self.n_batch = 512
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.kv_tokens: list[int] = []  # tokens whose KV the draft context holds, positions 0..
        self.exact = 0  # leading cells computed by full prefill chunks (reusable, see prefix_cache.py)
        self.n_alternatives = n_alternatives
        self.n_evals = 0

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry of a token id (to compare the draft's vocabulary with the target's)."""
        return self.lib.llama_vocab_get_text(self.vocab, token)

    def _decode(self, tokens: list[int], start: int) -> np.ndarray:
        """Append tokens at positions start.. to sequence 0; return the last row's logits."""
        lib = self.lib
        for off in range(0, len(tokens), self.n_batch):
            chunk = tokens[off:off + self.n_batch]
            b = self.batch
            b.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = start + off + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = i == len(chunk) - 1
            rc = lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"draft model decode failed (llama_decode returned {rc}); the draft context may be full, raise --ctx")
            self.n_evals += 1
        ptr = lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)).copy()

    def _sync(self, path: list[int]) -> np.ndarray:
        """Make the KV hold path[:-1]... plus path[-1], reusing the longest shared prefix."""
        common = 0
        limit = min(len(self.kv_tokens), len(path) - 1)  # always re-feed at least the last token
        while common < limit and self.kv_tokens[common] == path[common]:
            common += 1
        if common < len(self.kv_tokens):
            self.lib.llama_memory_seq_rm(self.mem, 0, common, -1)
            del self.kv_tokens[common:]
        new = path[common:]
        # One token at a time, as plain decoding does: a batch would round differently (see the
        # native engine's batch_invariant), and a draft identical to the target must agree with it.
        for i, t in enumerate(new):
            logits = self._decode([t], common + i)
        self.kv_tokens.extend(new)
        return logits

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        """Begin a request: process the prompt in the same chunks as the target's prefill.

        reuse: as many leading prompt tokens as the target keeps; this cache keeps those of them
        that its own full prefill chunks computed, as the target does (`prefix_cache.py`), so that
        it drafts exactly as it would after a fresh start.
        """
        with PROCESS.charge(DRAFT):
            self._start(prompt, reuse)

    def _start(self, prompt: list[int], reuse: int) -> None:
        keep = min(reuse, PrefixCache(self.kv_tokens, self.exact).plan(prompt)[0]) if reuse > 0 else 0
        if keep:
            self.lib.llama_memory_seq_rm(self.mem, 0, keep, -1)
        else:
            self.lib.llama_memory_seq_rm(self.mem, -1, -1, -1)
        for b, e in prefill_chunks(keep, len(prompt)):
            self._decode(prompt[b:e], b)
        self.kv_tokens = list(prompt)
        self.exact = chunk_floor(len(prompt))

    def read_context(self, tokens: list[int]) -> None:
        """Hold only `tokens`, at positions 0.. (in one batch): a short context to draft from
        without reading the prompt (a cost probe, draft_economy.py). The next `start` reads the
        prompt afresh."""
        with PROCESS.charge(DRAFT):
            self.lib.llama_memory_seq_rm(self.mem, -1, -1, -1)
            if tokens:
                self._decode(tokens, 0)
        self.kv_tokens, self.exact = list(tokens), 0

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        if n_max <= 0:
            return Proposal([], [], [])
        with PROCESS.charge(DRAFT):
            return self._propose(path, n_max, p_min)

    def _propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        out = Proposal([], [], [])
        logits = self._sync(path)
        while True:
            top, p = softmax_top(logits, self.n_alternatives)
            tok, conf = int(top[0]), float(p[0])
            if conf < p_min and out.tokens:
                break
            out.tokens.append(tok)
            out.probs.append(conf)
            out.alternatives.append([(int(t), float(q)) for t, q in zip(top[1:], p[1:])])
            if len(out.tokens) >= n_max or conf < p_min:
                break
            logits = self._decode([tok], len(self.kv_tokens))
            self.kv_tokens.append(tok)
        return out

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        self.llm.close()


class NoDraft:
    """The drafter of a request that has none: every proposal is empty (single-token runs)."""

    name = "none"
    has_prompt_pass = False

    @property
    def kv_tokens(self) -> list[int]:
        return []

    def start(self, prompt: list[int], reuse: int = 0) -> None: ...

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        return Proposal([], [], [])

    def close(self) -> None: ...

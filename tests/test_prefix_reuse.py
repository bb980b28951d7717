"""Prefix reuse under real mpiexec: a second chat turn keeps the first turn's KV cells on every rank
(and in the draft's cache) and prints exactly the tokens a fresh prefill gives, in every mode."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from pipeinfer_cli.decode.prefix_cache import PrefixCache, whole_chunks
from pipeinfer_cli.decode.session import chunk_floor, prefill_chunks
from pipeinfer_cli.native import LayerEngine
from pipeinfer_cli.transport.launch import find_mpiexec

JOB = Path(__file__).with_name("reuse_job.py")
# A first message long enough (> 256 tokens) that whole prefill chunks can be kept.
DOC = " ".join(f"Item {i}: the {w} fox jumps over the lazy dog." for i, w in
               enumerate(["quick", "brown", "red", "slow", "grey", "small", "old", "young"] * 6))
TURNS = [{"user": f"Here is a list.\n{DOC}\nWhich colours appear?"}, {"user": "Name one of them."}]


def run_job(model, ranks: int, mode: str, steps: list, draft=None, layer_split=None, reuse=True, n=24,
            timeout=400) -> list[dict]:
    spec = {"model": str(model), "draft": None if draft is None else str(draft), "mode": mode, "n": n, "ctx": 2048,
            "layer_split": layer_split, "reuse": reuse, "steps": steps, "p_accept": 0.0}
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, str(JOB), json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@lru_cache(maxsize=None)
def baseline(model: str, steps_json: str) -> tuple:
    """The tokens of every request on one rank, iterative, the cache cleared before each."""
    out = run_job(model, 1, "iterative", json.loads(steps_json), reuse=False)
    return tuple(tuple(r["tokens"]) for r in out if r["kind"] == "request")


def check_cells(lines: list[dict], target_ranks: list[str]) -> None:
    """After a request every target rank holds exactly the committed tokens; after a reset, nothing."""
    for r in lines:
        for rank in target_ranks:
            want = 0 if r["kind"] == "reset" else r["n_prompt"] + r["n_gen"] - 1
            assert r["kv"][rank] == want, (rank, r["kind"], r["kv"])
        if r["kind"] == "reset":
            assert all(v == 0 for v in r["kv"].values()), r["kv"]  # the draft rank's cache too


@pytest.mark.mpi
@pytest.mark.parametrize("mode, ranks, draft, layer_split", [
    ("iterative", 2, None, None),
    ("speculative", 2, "self", None),
    ("pipeinfer", 2, "self", None),
    ("pipeinfer", 3, "self", "0.5,0.5/1"),   # a draft rank
])
def test_second_chat_turn_reuses_the_first_and_prints_the_same(smollm2_path, mode, ranks, draft, layer_split):
    steps = TURNS + ["reset", TURNS[0]]
    want = baseline(str(smollm2_path), json.dumps(TURNS))
    lines = run_job(smollm2_path, ranks, mode, steps, draft=smollm2_path if draft == "self" else draft,
                    layer_split=layer_split)
    first, second, reset, again, fresh = lines
    assert (tuple(first["tokens"]), tuple(second["tokens"])) == want
    assert first["reused_tokens"] == 0
    # The second turn starts with the first turn's whole prompt; whole chunks of it are kept.
    assert second["common_prefix_tokens"] >= first["n_prompt"] > 256
    assert second["reused_tokens"] == whole_chunks(first["n_prompt"]) > 0
    # After /reset the same first turn is computed from scratch: same tokens, nothing reused.
    assert again["reused_tokens"] == 0 and again["tokens"] == first["tokens"]
    # The last request replayed on an empty cache ("fresh") prints the same tokens as with reuse.
    assert fresh["tokens"] == again["tokens"]
    if mode == "speculative" and draft == "self":
        # The draft's cache was reused the same way: it proposed exactly what it proposes afresh.
        assert second["acceptance"] == baseline_acceptance(smollm2_path, ranks)
    n_target = ranks - (1 if layer_split and "/" in layer_split else 0)
    check_cells(lines, [str(r) for r in range(n_target)])


@lru_cache(maxsize=None)
def _second_turn_fresh(model: str, ranks: int) -> str:
    lines = run_job(model, ranks, "speculative", TURNS, draft=model, reuse=False)
    return json.dumps(lines[1]["acceptance"])


def baseline_acceptance(model, ranks: int) -> dict:
    """Speculative mode's acceptance on the second turn, the cache cleared between turns."""
    return json.loads(_second_turn_fresh(str(model), ranks))


@pytest.mark.mpi
def test_a_prompt_that_diverges_keeps_only_the_common_prefix(tiny_pair):
    """Raw prompts on a tiny target with a poor draft (many cancelled runs): a prompt sharing about
    330 characters keeps the whole prefill chunks of that prefix, one sharing 100 keeps those of its
    prefix; the tokens are those of a fresh prefill, and every rank holds exactly the committed
    tokens after each request."""
    target, draft = tiny_pair
    base = "".join(chr(97 + (i * 7) % 26) for i in range(700))
    steps = [{"prompt": base}, {"prompt": base[:330] + "zzzz different ending"},
             {"prompt": base[:100] + "another turn"}]
    want = baseline(str(target), json.dumps(steps))
    lines = run_job(target, 2, "pipeinfer", steps, draft=draft)
    a, b, c, fresh = lines
    assert tuple(tuple(r["tokens"]) for r in (a, b, c)) == want
    assert fresh["tokens"] == c["tokens"]
    assert 256 <= b["common_prefix_tokens"] < a["n_prompt"]
    assert b["reused_tokens"] == chunk_floor(b["common_prefix_tokens"]) >= 256
    assert 0 < c["common_prefix_tokens"] < b["common_prefix_tokens"]
    assert c["reused_tokens"] == chunk_floor(c["common_prefix_tokens"]) > 0
    check_cells(lines, ["0", "1"])


def test_reused_cells_are_bit_identical_to_a_fresh_prefill(smollm2_path):
    """What the rule rests on, on the native engine: keeping whole prefill chunks gives the logits of
    a fresh prefill bit for bit, while keeping the cells of decoded tokens (llama.cpp's prompt cache)
    does not."""
    n_layer = LayerEngine(str(smollm2_path), 0, 1).n_layer
    rng = np.random.default_rng(0)
    first, answer, turn = (rng.integers(10, 20000, n).tolist() for n in (300, 24, 20))

    def engine():
        return LayerEngine(str(smollm2_path), 0, n_layer, n_ctx=1024, n_threads=2)

    def ev(e, toks, p0, invariant, want_last=True):
        out = np.zeros(len(toks), bool)
        out[-1] = want_last
        return e.eval(tokens=np.asarray(toks, np.int32), pos=np.arange(p0, p0 + len(toks), dtype=np.int32),
                      seq_ids=[[0]] * len(toks), output=out, batch_invariant=invariant)

    def prefill(e, toks, start=0):
        for b, end in prefill_chunks(start, len(toks)):
            res = ev(e, toks[b:end], b, False, want_last=end == len(toks))
        return res[-1]

    full = first + answer + turn
    fresh = prefill(engine(), full)
    e = engine()
    prefill(e, first)
    for i, t in enumerate(answer):  # the first turn's answer, decoded one token at a time
        ev(e, [t], len(first) + i, True)
    cache = PrefixCache(first + answer, whole_chunks(len(first)))
    keep, common = cache.plan(full)
    assert (keep, common) == (chunk_floor(len(first)), len(first) + len(answer)) and keep == 256
    everything = ev(e, turn, len(first) + len(answer), False)[-1]  # keep every cell, prefill the turn
    e.seq_rm(0, keep, -1)
    assert np.array_equal(prefill(e, full, start=keep), fresh)
    assert not np.array_equal(everything, fresh)

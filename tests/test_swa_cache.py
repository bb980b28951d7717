"""Gemma 3's sliding-window cache: its local layers keep only their window (n_swa + 512 cells),
as llama.cpp's default SWA cache does, and every mode prints exactly the tokens of the full cache
(PIPEINFER_SWA_FULL=1), beyond the window and beyond the window cache's size (cells pruned and
reused), with rejected drafts, cancelled runs and a prefix-reuse second turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pipeinfer_cli.decode.prefix_cache import PrefixCache
from pipeinfer_cli.native import LayerEngine
from pipeinfer_cli.transport.launch import find_mpiexec
from test_generate_mpi import run
from test_prefix_reuse import JOB

MIB = 1 << 20
# About 990 Gemma 3 tokens: with 64 generated the context passes the 1024-cell window cache.
PARAGRAPH = ("The river carries silt from the mountains to the sea, and every spring the floods spread it "
             "over the plain where farmers plant barley, beans and flax.")
PROMPT = " ".join([PARAGRAPH] * 33)
SAMPLING = {"greedy": [], "seeded": ["--temp", 0.8, "--seed", 7]}


@pytest.fixture(autouse=True)
def window_unless_full(monkeypatch):
    """The window cache even where the size rule would keep the full one (PIPEINFER_SWA_FULL=0);
    swa_full=True still asks for the full cache."""
    monkeypatch.setenv("PIPEINFER_SWA_FULL", "0")


def test_window_cache_is_a_fraction_of_the_full_cache_at_32768(gemma3_path):
    """KV bytes per rank at --ctx 32768, one rank and two (9 + 9 layers): full vs window."""
    got = {}
    for split in ([(0, 18)], [(0, 9), (9, 18)]):
        for full in (True, False):
            sizes = []
            for lo, hi in split:
                e = LayerEngine(gemma3_path, lo, hi, n_ctx=32768, n_seq_max=8, swa_full=full)
                sizes.append(e.kv_bytes)
                assert e.kv_swa_size == (0 if full else 1024)
                del e
            got[(len(split), full)] = sizes
    print("KV MiB per rank at --ctx 32768:", {f"{n} rank(s), {'full' if f else 'window'}": [s / MIB for s in v]
                                             for (n, f), v in got.items()})
    assert got[(1, True)] == [576 * MIB]          # 18 layers x 32768 cells x 256 x (K+V) x f16
    assert got[(1, False)] == [(96 + 15) * MIB]   # 3 global layers x 32768 + 15 local x 1024
    assert got[(2, True)] == [288 * MIB, 288 * MIB]
    assert got[(2, False)] == [(32 + 8) * MIB, (64 + 7) * MIB]  # layer 5 | layers 11 and 17 are global


def test_window_cache_logits_are_bit_identical_to_the_full_cache(gemma3_path):
    """Prompt chunks, one-token decoding past the window cache's size, a branch rolled back and a
    token tree (two sequences at the same positions): logits equal bit for bit."""
    rng = np.random.default_rng(3)
    toks = rng.integers(100, 20000, 1200).astype(np.int32)

    def steps(full: bool) -> list[np.ndarray]:
        e = LayerEngine(gemma3_path, 0, 18, n_ctx=2048, n_seq_max=4, swa_full=full)
        out = []
        for c in range(0, 1024, 256):
            out.append(e.eval(toks[c:c + 256], pos=np.arange(c, c + 256), seq_ids=[[0]] * 256, output=[True] * 256))
        for p in range(1024, 1100):  # past the window cache's 1024 cells: the oldest are pruned and reused
            out.append(e.eval(toks[p:p + 1], pos=[p], seq_ids=[[0]]))
        e.seq_cp(0, 1)
        out.append(e.eval(toks[1100:1104], pos=np.arange(1100, 1104), seq_ids=[[1]] * 4, output=[True] * 4,
                          batch_invariant=True))
        e.seq_rm(1, 1101, -1)  # a rejected draft
        out.append(e.eval(toks[1105:1106], pos=[1101], seq_ids=[[1]]))
        e.seq_cp(0, 2)
        e.seq_cp(0, 3)
        out.append(e.eval(toks[1110:1114], pos=[1100, 1100, 1101, 1101], seq_ids=[[2], [3], [2], [3]],
                          output=[True] * 4, batch_invariant=True))
        if not full:
            assert e.kv_swa_size == 1024 and e._eng.kv_swa_used_cells() <= 1024
        return out

    for a, b in zip(steps(True), steps(False), strict=True):
        assert np.array_equal(a, b)


def generate(ranks: int, mode: str, sampling: str, draft: str | None, full: bool) -> list[int]:
    args = ["gemma3-270m", "-p", PROMPT, "-n", 64, "--threads", 1, "--ranks", ranks, "--mode", mode,
            "--json", *SAMPLING[sampling]]
    if draft:
        args += ["--draft", draft]
    r = run(*args, timeout=600, PIPEINFER_SWA_FULL="1" if full else "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n_prompt"] + out["n_gen"] > 1024 and out["n_gen"] == 64
    return out["tokens"]


@pytest.fixture(scope="module")
def full_cache_tokens(gemma3_path) -> dict:
    return {s: generate(1, "iterative", s, None, True) for s in SAMPLING}


CASES = [(1, "iterative", "greedy", None), (1, "iterative", "seeded", None),
         (2, "speculative", "greedy", "lookup"), (2, "pipeinfer", "seeded", "lookup"),
         (1, "pipeinfer", "greedy", "lookup"), (2, "pipeinfer", "greedy", "gemma3-270m"),
         (1, "speculative", "seeded", "gemma3-270m")]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, mode, sampling, draft", CASES,
                         ids=[f"{m}-{r}-{s}-{d}" for r, m, s, d in CASES])
def test_window_cache_prints_the_full_cache_tokens(full_cache_tokens, ranks, mode, sampling, draft):
    assert generate(ranks, mode, sampling, draft, False) == full_cache_tokens[sampling]


def reuse_turns(model, full: bool) -> list[dict]:
    first = f"Here is a text. {' '.join([PARAGRAPH] * 33)} The river carries"
    turns = [{"prompt": first}, {"prompt": first + " silt. What do the farmers plant? They plant"},
             {"prompt": f"Here is a text. {' '.join([PARAGRAPH] * 12)} Now something else: the weather"}]
    spec = {"model": str(model), "draft": "lookup", "mode": "pipeinfer", "n": 32, "ctx": 2048, "layer_split": None,
            "reuse": True, "steps": turns, "p_accept": 0.0}
    env = dict(os.environ, PIPEINFER_SWA_FULL="1" if full else "0")
    cmd = [find_mpiexec(), "-n", "2", sys.executable, str(JOB), json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.mpi
def test_window_cache_prefix_reuse_turn_prints_the_full_cache_tokens(gemma3_path):
    window, full = reuse_turns(gemma3_path, False), reuse_turns(gemma3_path, True)
    assert [r["tokens"] for r in window] == [r["tokens"] for r in full]
    first, second, third = [r for r in window if r["kind"] == "request"][:3]
    assert first["n_prompt"] + first["n_gen"] > 1024  # the first turn outgrew the window cache: cells were pruned
    assert second["reused_tokens"] >= 768  # whole 256-token chunks, longer than the window
    # A prompt sharing only 256 tokens: the full cache keeps them; the window cache pruned the cells
    # their continuation's window needs, so it prefills from 0 (the same chunks: the same cells).
    assert [r for r in full if r["kind"] == "request"][2]["reused_tokens"] == 256
    assert third["reused_tokens"] == 0 and third["common_prefix_tokens"] >= 256


def test_prefix_plan_keeps_nothing_shorter_than_the_window_cache_allows():
    cache = PrefixCache(list(range(2000)), 1024, min_resume=600)
    assert cache.plan(list(range(700)) + [-1])[0] == 0
    assert cache.plan(list(range(1100)))[0] == 1024

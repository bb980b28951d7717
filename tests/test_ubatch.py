"""--ubatch N: the prompt computed in chunks of N tokens from its start, as llama.cpp's -ub batches it
(decode/session.prefill_chunks), so that a user can reproduce llama.cpp's greedy tokens exactly; every
mode keeps iterative's tokens at any N, and prefix reuse keeps only whole chunks of that size."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeinfer_cli.decode.modes import MODE_NAMES
from pipeinfer_cli.decode.prefix_cache import PrefixCache
from pipeinfer_cli.decode.request import run_request
from pipeinfer_cli.decode.sampling import SamplingParams
from pipeinfer_cli.decode.session import DecodeOptions, chunk_floor, prefill_chunks
from pipeinfer_cli.decode.virtual_pipeline import VirtualPipeline
from test_request_runner import Oracle, target_logits


def test_chunks_of_ubatch_tokens_from_the_start():
    assert prefill_chunks(0, 1200, 512) == [(0, 512), (512, 1024), (1024, 1200)]
    assert prefill_chunks(0, 40, 512) == [(0, 40)]  # llama.cpp's one batch
    assert prefill_chunks(14, 30, 7) == [(14, 21), (21, 28), (28, 30)]
    assert chunk_floor(700, 512) == 512 and chunk_floor(511, 512) == 0
    with pytest.raises(ValueError):
        prefill_chunks(16, 40, 512)  # not a boundary of these chunks
    # the default (no --ubatch) is unchanged: small chunks first
    assert prefill_chunks(0, 70) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]


def test_prefix_reuse_keeps_whole_chunks_of_the_job_s_size():
    cache = PrefixCache(ubatch=512)
    prompt = list(range(1100))
    cache.after_request(prompt, prompt + [7, 8])
    assert cache.exact == 1024
    keep, common = cache.plan(prompt[:700] + [5])
    assert (keep, common) == (512, 700)
    assert prefill_chunks(keep, 701, 512) == [(512, 701)]
    cache.clear()
    assert cache.ubatch == 512 and cache.tokens == []


@pytest.mark.parametrize("ubatch", [None, 1, 7, 512])
def test_every_mode_prints_iterative_s_tokens_at_any_ubatch(ubatch):
    """On a virtual pipeline of two stages: the prompt goes out in the chunks --ubatch asks for, and
    every mode commits the tokens iterative commits."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 5
    got = {}
    for mode in MODE_NAMES:
        pipe = VirtualPipeline(target_logits, latency=2)
        drafter = Oracle(pipe) if mode != "iterative" else None
        s = run_request(pipe, mode, prompt, DecodeOptions(n_predict=24, ubatch=ubatch), drafter,
                        sampling=SamplingParams(), n_predict=24, is_eog=lambda t: False)
        got[mode] = s.tokens[len(prompt):]
        chunks = [len(op[1]) for op in pipe.ops("launch")[:len(prefill_chunks(0, len(prompt), ubatch))]]
        assert chunks == [e - b for b, e in prefill_chunks(0, len(prompt), ubatch)], mode
    assert all(t == got["iterative"] for t in got.values()), got


# -- the command, on SmolLM2 ------------------------------------------------------------------------
PROMPT = ("Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the "
          "lazy dog. The quick brown fox")
N_GEN = 24


def generate(model, *args) -> dict:
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(model), "-p", PROMPT, "-n", str(N_GEN),
                        "--ctx", "512", "--threads", "1", "--json", *map(str, args)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def llama_cpp_greedy(path, prompt: list[int], n_new: int) -> list[int]:
    """llama-cpp-python's own greedy tokens: its prompt pass (n_batch = n_ubatch = 512), then one
    token at a time, argmax of the last logits row."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, logits_all=True,
                          verbose=False)
    try:
        llm.eval(prompt)
        out = []
        for _ in range(n_new):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


def test_ubatch_512_is_llama_cpp_s_greedy_output_and_every_mode_keeps_it(smollm2_path):
    """`--ubatch 512` prints llama-cpp-python's greedy tokens; at another --ubatch (7: the prompt in many
    chunks) pipeinfer on 2 ranks and speculative on 1, both with prompt lookup, print iterative's.
    (On SmolLM2's Q4_1 weights this machine's ggml computes the same logits at any chunk size, so
    the default chunks agree too; the option is what holds where they do not.)"""
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    prompt = tok.encode(PROMPT)
    tok.close()
    assert len(prompt) > 16  # more than one of the default chunks
    want = llama_cpp_greedy(smollm2_path, prompt, N_GEN)
    one = generate(smollm2_path, "--ubatch", 512)
    assert one["n_prompt"] == len(prompt) and one["tokens"] == want[:len(one["tokens"])]
    base = generate(smollm2_path, "--ranks", 2, "-ub", 7)  # iterative: the tokens of that --ubatch
    for args in (("--ranks", 2, "--ubatch", 7, "-M", "pipeinfer", "--draft", "lookup"),
                 ("-ub", 7, "-M", "speculative", "--draft", "lookup")):
        got = generate(smollm2_path, *args)
        assert got["tokens"] == base["tokens"], args
        assert got["acceptance"]["drafted"] > 0, args  # the prompt repeats: lookup drafts

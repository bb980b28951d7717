"""Long prompts in the lossless matrix: prompts of 255, 256, 257, 1000 and 3000 tokens (around and
far beyond one 256-token prefill chunk) generate in every mode on 1, 2 and 3 ranks, greedy and
seeded, with identical tokens everywhere; greedy tokens equal llama.cpp's own.

One `pipeinfer bench` job per (ranks, sampling) runs every mode over all five prompts on models
loaded once; bench itself exits 1 when modes disagree, and the test compares across jobs too.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

LENGTHS = (255, 256, 257, 1000, 3000)
N_GEN = 6
MODES = "iterative,speculative,pipeinfer"
SAMPLING = {"greedy": [], "seeded": ["--temp", "0.9", "--seed", "11"]}
# (ranks, draft): a real draft model on some topologies, prompt lookup on others.
TOPOLOGIES = [(1, "self"), (2, "lookup"), (3, "self")]
WORDS = ("the of and to in is was for on that with as by at from his her they which this be are or an have not "
         "one had were but all when there can more first also into been has time after new other some would these "
         "may its river stone light house music paper garden window city market winter").split()


@lru_cache(maxsize=None)
def _tokenizer(path: str):
    from pipeinfer_cli.engine.tokenizer import Tokenizer

    return Tokenizer(Path(path))


def text_of_length(path: Path, n_tokens: int, seed: int) -> str:
    """Varied text that the model's tokenizer turns into exactly n_tokens tokens (BOS included)."""
    tok = _tokenizer(str(path))
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n_tokens)]  # about one token each
    while len(tok.encode(" ".join(words))) > n_tokens:
        words.pop()
    text = " ".join(words)
    assert len(tok.encode(text)) == n_tokens, "the word list must be single tokens"
    return text


@pytest.fixture(scope="module")
def prompt_file(smollm2_path, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    with path.open("w") as f:
        for n in LENGTHS:
            f.write(json.dumps({"id": f"len{n}", "prompt": text_of_length(smollm2_path, n, seed=n)}) + "\n")
    return path


_jobs: dict[tuple, dict] = {}


def bench_tokens(model: Path, prompts: Path, ranks: int, draft: str, sampling: str) -> dict[tuple[str, str], list[int]]:
    """{(prompt id, mode): tokens} from one bench job over every mode and prompt."""
    key = (ranks, draft, sampling)
    if key not in _jobs:
        out = prompts.parent / f"r{ranks}-{draft}-{sampling}.json"
        cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", str(model), "--draft", str(model) if draft == "self" else draft,
               "--modes", MODES, "--prompts", str(prompts), "-n", str(N_GEN), "--ctx", "3200", "--repeat", "1",
               "--warmup", "0", "--threads", "1", "--ranks", str(ranks), "--json", str(out), *SAMPLING[sampling]]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(out.read_text())
        assert doc["tokens_identical"] is True, doc["token_mismatches"]
        _jobs[key] = {(x["prompt_id"], x["mode"]): x for x in doc["records"]}
    return _jobs[key]


def llama_cpp_greedy(path: Path, prompt: list[int], n_new: int) -> list[int]:
    """llama.cpp's greedy tokens, the prompt processed in batches of 256 like pipeinfer's prefill."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=3200, n_batch=256, n_ubatch=256, n_threads=1, verbose=False)
    try:
        llm.eval(prompt)
        out = []
        for _ in range(n_new):
            last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            out.append(int(np.argmax(np.ctypeslib.as_array(last, shape=(llm.n_vocab(),)))))
            if llm._model.token_eos() == out[-1]:
                break
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("ranks, draft", TOPOLOGIES)
def test_long_prompts_identical_in_every_mode(smollm2_path, prompt_file, ranks, draft, sampling):
    got = bench_tokens(smollm2_path, prompt_file, ranks, draft, sampling)
    reference = bench_tokens(smollm2_path, prompt_file, 1, "self", sampling)
    for n in LENGTHS:
        want = reference[(f"len{n}", "iterative")]
        assert want["n_prompt"] == n
        assert want["n_gen"] >= 1
        for mode in MODES.split(","):
            rec = got[(f"len{n}", mode)]
            assert rec["n_prompt"] == n
            assert rec["tokens"] == want["tokens"], f"{n}-token prompt, {mode} on {ranks} ranks differs from iterative on 1"


@pytest.mark.parametrize("n", LENGTHS)
def test_long_prompt_greedy_equals_llama_cpp(smollm2_path, prompt_file, n):
    tok = _tokenizer(str(smollm2_path))
    prompt = tok.encode(text_of_length(smollm2_path, n, seed=n))
    got = bench_tokens(smollm2_path, prompt_file, 2, "lookup", "greedy")[(f"len{n}", "iterative")]["tokens"]
    want = llama_cpp_greedy(smollm2_path, prompt, N_GEN)
    assert got == want[:len(got)]
    if len(got) < N_GEN:
        assert tok.is_eog(got[-1])

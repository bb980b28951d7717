"""Long prompts in the lossless matrix: prompts of 255, 256, 257, 1000 and 3000 tokens (around and
far beyond one 256-token prefill chunk) generate in every mode on 1, 2 and 3 ranks, greedy and
seeded, with identical tokens everywhere; greedy tokens equal llama.cpp's own.

One `pipeinfer bench` job per (model, ranks, draft, sampling) runs every mode over all five prompts
on models loaded once; bench itself exits 1 when modes disagree, and the tests compare across jobs.

- The whole matrix runs on a tiny qwen2 file (random weights, a perturbed copy as its draft, so
  drafts are partly accepted and partly rolled back), where 3000-token prompts cost little.
- SmolLM2 (a real model) runs every length in every mode on 2 ranks against llama.cpp; its whole
  matrix, about 20 minutes on 2 cores, is `make test-slow` (marker `slow`).
- `make test` keeps these long prompts on SmolLM2's Q4_1 weights, through the native engine and
  llama_cpp (not marked slow): batches of hundreds of rows on a quantized type are what ggml's AMX
  kernels take, the ones that die of SIGILL where AMX is not enabled (issue 35; `make install`'s
  probe, scripts/install_llama_cpp.py, runs such a prompt too).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tinygguf import write_tiny_model

pytestmark = pytest.mark.mpi

LENGTHS = (255, 256, 257, 1000, 3000)
N_GEN = 6
MODES = "iterative,speculative,pipeinfer"
SAMPLING = {"greedy": [], "seeded": ["--temp", "0.9", "--seed", "11"]}
# (ranks, draft): a draft model on some topologies, prompt lookup on others.
TOPOLOGIES = [(1, "model"), (2, "lookup"), (3, "model")]
WORDS = ("the of and to in is was for on that with as by at from his her they which this be are or an have not "
         "one had were but all when there can more first also into been has time after new other some would these "
         "may its river stone light house music paper garden window city market winter").split()


_OPEN_TOKENIZERS: dict = {}  # path -> Tokenizer, closed when the module's tests end


def _tokenizer(path: str):
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    if path not in _OPEN_TOKENIZERS:
        _OPEN_TOKENIZERS[path] = Tokenizer(Path(path))
    return _OPEN_TOKENIZERS[path]


def text_of_length(path: Path, n_tokens: int, seed: int) -> str:
    """Varied text that the model's tokenizer turns into exactly n_tokens tokens (BOS included)."""
    tok = _tokenizer(str(path))
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n_tokens)]  # at least one token each
    lo, hi = 0, len(words)  # the longest prefix of words with at most n_tokens tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode(" ".join(words[:mid]))) <= n_tokens else (lo, mid - 1)
    text = " ".join(words[:lo])
    while (n := len(tok.encode(text))) < n_tokens:  # top up one character at a time
        for c in " zqjxkv":
            if len(tok.encode(text + c)) == n + 1:
                text += c
                break
        else:
            raise AssertionError(f"cannot reach {n_tokens} tokens")
    assert len(tok.encode(text)) == n_tokens
    return text


@dataclass(frozen=True)
class Case:
    name: str
    target: Path
    draft: Path
    prompts: Path


def _write_prompts(path: Path, model: Path) -> Path:
    with path.open("w") as f:
        for n in LENGTHS:
            f.write(json.dumps({"id": f"len{n}", "prompt": text_of_length(model, n, seed=n)}) + "\n")
    return path


@pytest.fixture(scope="module", autouse=True)
def _close_tokenizers():
    yield
    for path in list(_OPEN_TOKENIZERS):
        _OPEN_TOKENIZERS.pop(path).close()


@pytest.fixture(scope="module")
def cases(smollm2_path, tmp_path_factory) -> dict[str, Case]:
    d = tmp_path_factory.mktemp("long")
    target = write_tiny_model(d / "target.gguf", arch="qwen2", n_layer=4, seed=0)
    draft = write_tiny_model(d / "draft.gguf", arch="qwen2", n_layer=4, seed=0, scale=0.07)
    return {
        "tiny-qwen2": Case("tiny-qwen2", target, draft, _write_prompts(d / "tiny.jsonl", target)),
        "smollm2": Case("smollm2", smollm2_path, smollm2_path, _write_prompts(d / "smollm2.jsonl", smollm2_path)),
    }


_jobs: dict[tuple, dict] = {}


def bench_records(case: Case, ranks: int, draft: str, sampling: str, split: str | None = None) -> dict[tuple[str, str], dict]:
    """{(prompt id, mode): record} from one bench job over every mode and prompt."""
    key = (case.name, ranks, draft, sampling, split)
    if key not in _jobs:
        out = case.prompts.parent / f"{case.name}-r{ranks}-{draft}-{sampling}-{split}.json".replace(",", "_")
        cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", str(case.target),
               "--draft", str(case.draft) if draft == "model" else draft, "--modes", MODES, "--prompts", str(case.prompts),
               "-n", str(N_GEN), "--ctx", "3200", "--repeat", "1", "--warmup", "0", "--threads", "1",
               "--ranks", str(ranks), "--json", str(out), *SAMPLING[sampling], *(["--layer-split", split] if split else []),
               # On one rank `auto` would stop a draft that does not pay after a run or two; these
               # tests are about speculation over long contexts, so they keep it drafting.
               "--spec-policy", "always"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(out.read_text())
        assert doc["tokens_identical"] is True, doc["token_mismatches"]
        _jobs[key] = {(x["prompt_id"], x["mode"]): x for x in doc["records"]}
    return _jobs[key]


def check_against_reference(case: Case, ranks: int, draft: str, sampling: str, reference: tuple,
                            split: str | None = None) -> None:
    got = bench_records(case, ranks, draft, sampling, split)
    want_job = bench_records(case, *reference, sampling)
    for n in LENGTHS:
        want = want_job[(f"len{n}", "iterative")]
        assert want["n_prompt"] == n and want["n_gen"] >= 1
        for mode in MODES.split(","):
            rec = got[(f"len{n}", mode)]
            assert rec["n_prompt"] == n
            assert rec["tokens"] == want["tokens"], f"{n}-token prompt: {mode} on {ranks} ranks differs from iterative"
        if draft == "model":
            assert sum(got[(f"len{n}", m)]["acceptance"]["drafted"] for m in ("speculative", "pipeinfer")) > 0


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
def test_long_prompts_identical_in_every_mode_tiny(cases, ranks, draft, sampling):
    check_against_reference(cases["tiny-qwen2"], ranks, draft, sampling, reference=(1, "model"))


def test_long_prompts_with_a_one_layer_last_stage(cases):
    """A last stage of one layer stores the K/V of prompt chunks that ask for no rows (it crashed once)."""
    check_against_reference(cases["tiny-qwen2"], 3, "lookup", "greedy", reference=(1, "model"), split="2,1,1")


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("ranks, draft", TOPOLOGIES)
def test_long_prompts_identical_in_every_mode_smollm2(cases, ranks, draft, sampling):
    check_against_reference(cases["smollm2"], ranks, draft, sampling, reference=(1, "model"))


def test_long_prompts_on_smollm2_two_ranks(cases):
    """Every length, every mode, 2 ranks: identical tokens (bench checks it), equal to llama.cpp below."""
    check_against_reference(cases["smollm2"], 2, "lookup", "greedy", reference=(2, "lookup"))


@pytest.mark.parametrize("model", ["tiny-qwen2", "smollm2"])
@pytest.mark.parametrize("n", LENGTHS)
def test_long_prompt_greedy_equals_llama_cpp(cases, model, n):
    case = cases[model]
    tok = _tokenizer(str(case.target))
    prompt = tok.encode(text_of_length(case.target, n, seed=n))
    got = bench_records(case, 2, "lookup", "greedy")[(f"len{n}", "iterative")]["tokens"]
    want = llama_cpp_greedy(case.target, prompt, N_GEN)
    assert got == want[:len(got)]
    if len(got) < N_GEN:
        assert tok.is_eog(got[-1])

"""Replay of the fuzzing corpus (`make fuzz` runs the long campaign): every saved input, through
every GGUF reader, ends in success or a typed error, within the campaign's limits.

tests/fuzz_corpus/seeds: tiny models and SmolLM2's header (fuzz/make_seeds.py);
tests/fuzz_corpus/regressions: inputs that once crashed a reader, each fixed;
tests/fuzz_corpus/TARGET: a minimized sample of the campaign's corpus for that target.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fuzz_corpus"


# The inputs that crashed a reader, the target that crashed, and what its error now says.
REGRESSIONS = {
    ("metadata", "metadata-non-utf8-key.gguf"): ": ok",  # read, the key decoded with replacement characters
    ("metadata", "metadata-huge-block-count.gguf"): "more than the 512 llama.cpp supports",
    ("metadata", "native-infinite-embedding-length.gguf"): "is inf, not a count",
    ("tokenizer", "tokenizer-duplicate-token.gguf"): "twice",
    ("tokenizer", "tokenizer-bos-out-of-range.gguf"): "adds a BOS token to every prompt but has no valid BOS token",
    ("tokenizer", "tokenizer-spm-without-byte-tokens.gguf"): "has no byte token <0x00>",
    ("tokenizer", "tokenizer-rwkv-without-unknown-token.gguf"): "into token id -1, outside its vocabulary",
    ("tokenizer", "tokenizer-rwkv-endless-tokenize.gguf"): "begin with the byte \\x6c but not that byte alone",
    ("native", "native-block-count-array.gguf"): "block_count is an array",
    ("native", "native-block-count-differs-per-layer.gguf"): "block_count is an array",
    ("native", "native-string-rope-dimension-count.gguf"): "'llama.rope.dimension_count' is not an integer",
    ("native", "native-string-array-rope-dimension-count.gguf"): "is not an integer or an array of integers",
    ("native", "native-f16-output-norm.gguf"): "'output_norm.weight' has type f16, not f32",
    ("native", "native-i32-matmul-weight.gguf"): "type i32, a type with no matrix-multiply kernel",
    ("tokenizer", "tokenizer-non-utf8-metadata-value.gguf"): "is not valid UTF-8",
    ("tokenizer", "tokenizer-template-syntax-error.gguf"): "does not compile (TemplateSyntaxError",
    ("tokenizer", "tokenizer-template-undefined-name.gguf"): "chat template fails (UndefinedError",
    ("tokenizer", "tokenizer-template-raise-exception.gguf"): "chat template refuses these messages: no",
    ("tokenizer", "tokenizer-template-endless-recursion.gguf"): "chat template fails (RecursionError",
}


def _inputs(target: str) -> list[Path]:
    dirs = [CORPUS / "seeds", CORPUS / "regressions", CORPUS / target]
    return sorted(p for d in dirs if d.is_dir() for p in d.iterdir() if p.is_file())


@pytest.mark.parametrize("target", ["metadata", "native", "tokenizer"])
def test_corpus_replays_cleanly(target):
    files = _inputs(target)
    assert len(files) >= 8, "the corpus is missing; it is committed under tests/fuzz_corpus"
    proc = subprocess.run([sys.executable, str(ROOT / "fuzz" / "replay.py"), target, *map(str, files)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"replay of {target} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{target} ")]
    assert len(lines) == len(files)
    assert all(ln.endswith(": ok") or ": Error: " in ln for ln in lines), proc.stdout
    # The seeds include complete tiny models: the readers must accept them, not refuse everything.
    assert any(ln.endswith("tiny-llama-tied.gguf: ok") for ln in lines), proc.stdout
    # The inputs that once crashed this target now end in the error that names their problem.
    for (crashed, name), text in REGRESSIONS.items():
        if crashed == target:
            line = next(ln for ln in lines if f"/regressions/{name}: " in ln)
            assert text in line, line
    assert f"{target}: {len(files)} inputs, every one ended in success or an Error: line" in proc.stdout


def test_every_regression_input_has_its_expected_error():
    """Each file in regressions/ is checked for its specific error by the replay above."""
    names = {p.name for p in (CORPUS / "regressions").iterdir()}
    assert names == {name for _, name in REGRESSIONS}


def test_mutator_works_on_the_gguf_structure():
    """The fuzzer's mutator parses the seeds exactly and its mutations hit GGUF fields."""
    sys.path.insert(0, str(ROOT / "fuzz"))
    import gguf_struct
    import mutator

    seed = (CORPUS / "seeds" / "tiny-llama-tied.gguf").read_bytes()
    g = gguf_struct.parse(seed)
    assert g is not None and len(g.tensors) == 2 * 9 + 2 and g.get("llama.block_count").value == 2
    assert g.to_bytes() == seed  # parse + write is the identity on a well-formed file
    kinds = {f.kind for f in gguf_struct.scan(seed)}
    assert {"n_tensors", "n_kv", "str_len", "kv_type", "arr_len", "n_dims", "ne", "tensor_type", "tensor_offset"} <= kinds

    outs = [mutator.mutate(seed, 1 << 18, s) for s in range(300)]
    parsed = [gguf_struct.parse(o) for o in outs]
    assert sum(o != seed for o in outs) > 250
    # Most mutants are still GGUF files whose header parses (the mutations change fields, not
    # random bytes), and some of them change a tensor's shape or a key the readers use.
    assert sum(p is not None for p in parsed) > 150
    assert any(p is not None and [t.ne for t in p.tensors] != [t.ne for t in g.tensors] for p in parsed)
    known = set(mutator.known_keys("llama"))

    def known_values(x):
        return {kv.key: (kv.type, kv.value) for kv in x.kvs if kv.key in known}

    assert sum(p is not None and known_values(p) != known_values(g) for p in parsed) > 20

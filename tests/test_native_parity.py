"""The native layer engine computes what llama.cpp computes on the same GGUF file.

Measured tolerance: the native graph uses the same ggml ops in the same order, the same F16 KV
layout, the same KV padding (256 cells) and the same weight buffer types as llama.cpp, so the logits
are bit-identical to `llama_cpp.Llama(logits_all=True)` on every file tested here (tiny llama and
qwen2, SmolLM2 Q4_1, Qwen2.5-Coder 0.5B/1.5B Q4_K_M): max |Δ| = 0.0. The tests allow
`ATOL = 1e-3` absolute so that a harmless reordering in a future ggml does not fail them, and
require the argmax and the greedy tokens to be exactly equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeinfer_cli.native import LayerEngine
from tinygguf import GemmaParams, write_tiny_model

ATOL = 1e-3
N_DECODE = 16


def native_prefill(stages: list[LayerEngine], tokens: list[int], pos0: int = 0, all_rows: bool = True) -> np.ndarray:
    """Run tokens through consecutive stages (one sequence, id 0); return the last stage's logits."""
    n = len(tokens)
    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    seq_ids = [[0]] * n
    x = None
    for st in stages:
        if st.is_first:
            x = st.eval(tokens=np.array(tokens, np.int32), pos=pos, seq_ids=seq_ids,
                        output=np.ones(n, bool) if all_rows else None)
        else:
            x = st.eval(embd=x, pos=pos, seq_ids=seq_ids, output=np.ones(n, bool) if all_rows else None)
    return x


def native_greedy(stages: list[LayerEngine], prompt: list[int], n_new: int,
                  all_rows: bool = True) -> tuple[np.ndarray, list[int]]:
    logits = native_prefill(stages, prompt, all_rows=all_rows)
    out, cur, pos = [], int(logits[-1].argmax()), len(prompt)
    for _ in range(n_new):
        out.append(cur)
        cur = int(native_prefill(stages, [cur], pos0=pos, all_rows=False)[-1].argmax())
        pos += 1
    return logits, out


def llama_cpp_greedy(path, prompt: list[int], n_new: int, n_threads: int = 1, flash_attn: bool = False,
                     n_ctx: int = 512, all_rows: bool = True) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits of the prompt (every row, or only the last: no LM head over a long
    prompt) and its greedy continuation."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), logits_all=all_rows, n_ctx=n_ctx, n_threads=n_threads, verbose=False,
                          flash_attn=flash_attn)

    def last_row() -> np.ndarray:
        if all_rows:
            return np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        # Without logits_all llama-cpp-python keeps no scores; read the context's last output row.
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float32)

    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float32) if all_rows else last_row()[None, :]
    out, cur = [], int(logits[-1].argmax())
    for _ in range(n_new):
        out.append(cur)
        llm.eval([cur])
        cur = int(last_row().argmax())
    return logits, out


def split_ranges(n_layer: int, n_parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n_layer / n_parts) for i in range(n_parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def open_stages(path, n_layer: int, n_parts: int, n_threads: int = 1, flash_attn: bool = False,
                n_ctx: int = 512) -> list[LayerEngine]:
    return [LayerEngine(path, b, e, n_ctx=n_ctx, n_threads=n_threads, flash_attn=flash_attn)
            for b, e in split_ranges(n_layer, n_parts)]


def assert_parity(native: np.ndarray, ref: np.ndarray) -> None:
    assert native.shape == ref.shape
    np.testing.assert_allclose(native, ref, rtol=0, atol=ATOL)
    assert (native.argmax(axis=1) == ref.argmax(axis=1)).all()


TINY_PROMPT = [5, 17, 42, 100, 255, 7, 3, 280, 64, 1]


def assert_split_equals_single(path, n_layer: int, n_parts: int) -> None:
    """The model split into n_parts stages computes bit for bit what one stage computes."""
    single_logits, single_tokens = native_greedy(open_stages(path, n_layer, 1), TINY_PROMPT, N_DECODE)
    split_logits, split_tokens = native_greedy(open_stages(path, n_layer, n_parts), TINY_PROMPT, N_DECODE)
    np.testing.assert_array_equal(split_logits, single_logits)
    assert split_tokens == single_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_parity_and_greedy(tmp_path, arch):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, seed=3)
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, N_DECODE)
    logits, tokens = native_greedy(open_stages(path, 4, 1), TINY_PROMPT, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


def test_tiny_tied_output_parity(tmp_path):
    path = write_tiny_model(tmp_path / "tied.gguf", arch="qwen2", tied_output=True, seed=4)
    ref_logits, _ = llama_cpp_greedy(path, TINY_PROMPT, 0)
    assert_parity(native_prefill(open_stages(path, 4, 1), TINY_PROMPT), ref_logits)


@pytest.mark.parametrize("scaling", [("linear", 2.0), ("yarn", 4.0)])
def test_tiny_rope_scaling_parity(tmp_path, scaling):
    """RoPE scaling metadata (linear, YaRN) is applied as llama.cpp applies it."""
    path = write_tiny_model(tmp_path / "rope.gguf", arch="qwen2", rope_scaling=scaling, rope_orig_ctx=128,
                            rope_freq_base=50000.0, seed=9)
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, N_DECODE)
    logits, tokens = native_greedy(open_stages(path, 4, 1), TINY_PROMPT, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens
    assert LayerEngine(path, 0, 1, n_ctx=8).hparams()["rope_freq_scale"] == pytest.approx(1 / scaling[1])


@pytest.mark.parametrize("weight_type", ["f16", "q8_0", "q4_0"])
def test_tiny_quantized_parity(tmp_path, weight_type):
    """Quantized matrices match too; Q4_0 goes through CPU_REPACK (q4_0_8x8), as in llama.cpp."""
    path = write_tiny_model(tmp_path / f"{weight_type}.gguf", arch="llama", n_embd=128, n_head=4, n_head_kv=2,
                            n_ff=256, weight_type=weight_type, seed=5)
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, 8)
    stages = open_stages(path, 4, 1)
    if weight_type == "q4_0":
        assert stages[0].n_repacked == 4 * 7  # every layer matrix (the 300-row LM head is not a multiple of 8)
    logits, tokens = native_greedy(stages, TINY_PROMPT, 8)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_flash_attn_matches_llama_cpp_flash_attn(tmp_path, arch):
    """flash_attn=True is the other attention path; it matches llama.cpp run with flash_attn=True."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, seed=8)
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, N_DECODE, flash_attn=True)
    logits, tokens = native_greedy(open_stages(path, 4, 2, flash_attn=True), TINY_PROMPT, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.parametrize("n_parts", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_split_equals_single(tmp_path, arch, n_parts):
    assert_split_equals_single(write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, n_layer=6, seed=6), 6, n_parts)


# Gemma 3: a window of 4 positions on the local layers, shorter than the 10-token prompt, so the
# sliding-window mask decides most rows; layouts with every 3rd layer global, a per-layer pattern,
# and no window at all with a softcapped output and its own local RoPE base.
GEMMA_VARIANTS = {
    "period3": GemmaParams(),
    "pattern": GemmaParams(swa_pattern=[True, False, True, True, False, True]),
    "softcap": GemmaParams(n_swa=0, swa_pattern=None, rope_freq_base_swa=5000.0, final_logit_softcapping=3.0),
}


@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_tiny_gemma3_parity_and_greedy(tmp_path, variant):
    path = write_tiny_model(tmp_path / "gemma3.gguf", arch="gemma3", n_layer=6, seed=3, gemma=GEMMA_VARIANTS[variant])
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, N_DECODE)
    logits, tokens = native_greedy(open_stages(path, 6, 1), TINY_PROMPT, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens
    for n_parts in (2, 3):
        assert_split_equals_single(path, 6, n_parts)


def test_tiny_gemma3_window_covers_the_last_n_swa_positions(tmp_path):
    """Rows closer than the window to the start see every position either way; from position n_swa
    on, the local layers drop the oldest positions, so the logits differ from an unbounded window."""
    n_swa = GemmaParams().n_swa
    windowed = write_tiny_model(tmp_path / "w.gguf", arch="gemma3", n_layer=6, seed=3)
    unbounded = write_tiny_model(tmp_path / "u.gguf", arch="gemma3", n_layer=6, seed=3, gemma=GemmaParams(n_swa=1000))
    a = native_prefill(open_stages(windowed, 6, 1), TINY_PROMPT)
    b = native_prefill(open_stages(unbounded, 6, 1), TINY_PROMPT)
    np.testing.assert_array_equal(a[:n_swa], b[:n_swa])
    assert (np.abs(a[n_swa:] - b[n_swa:]).max(axis=1) > 1e-3).all()


SMOL_TEXT = b"The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def smol_prompt(smollm2_path) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(SMOL_TEXT, add_bos=True)
    finally:
        llm.close()  # not at interpreter exit, when llama_cpp's bindings are gone


@pytest.fixture(scope="module")
def smol_reference(smollm2_path, smol_prompt):
    return llama_cpp_greedy(smollm2_path, smol_prompt, N_DECODE)


def test_smollm2_parity_and_greedy(smollm2_path, smol_prompt, smol_reference):
    ref_logits, ref_tokens = smol_reference
    logits, tokens = native_greedy(open_stages(smollm2_path, 30, 1), smol_prompt, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.parametrize("n_parts", [2, 3])
def test_smollm2_split_equals_single(smollm2_path, smol_prompt, smol_reference, n_parts):
    ref_logits, ref_tokens = smol_reference
    stages = open_stages(smollm2_path, 30, n_parts)
    assert stages[0].is_first and stages[-1].is_last
    assert not any(s.is_last for s in stages[:-1])
    logits, tokens = native_greedy(stages, smol_prompt, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


def test_smollm2_two_threads_parity(smollm2_path, smol_prompt, smol_reference):
    ref_logits, ref_tokens = smol_reference
    logits, tokens = native_greedy(open_stages(smollm2_path, 30, 1, n_threads=2), smol_prompt, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen05_path", "qwen15_path"])
def test_qwen_parity_and_split(request, which):
    path = request.getfixturevalue(which)
    import llama_cpp

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    prompt = vocab.tokenize(b"def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", add_bos=False)
    vocab.close()
    ref_logits, ref_tokens = llama_cpp_greedy(path, prompt, N_DECODE, n_threads=2)
    n_layer = LayerEngine(path, 0, 1, n_ctx=16).n_layer
    logits, tokens = native_greedy(open_stages(path, n_layer, 1, n_threads=2), prompt, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens
    split_logits, split_tokens = native_greedy(open_stages(path, n_layer, 2, n_threads=2), prompt, N_DECODE)
    np.testing.assert_array_equal(split_logits, logits)
    assert split_tokens == tokens

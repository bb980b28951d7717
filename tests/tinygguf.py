"""Write tiny random-weight GGUF models (llama, qwen2, qwen3, gemma3, and mixture-of-experts qwen3moe and
llama layouts) that llama.cpp itself can load.

The vocabulary is GPT-2 byte-level: the 256 byte tokens in byte order, then a few merged tokens
and the special tokens, so any text tokenizes and the files work end to end without downloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _byte_tokens() -> list[str]:
    """GPT-2's reversible byte -> printable unicode mapping, as 256 token strings in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


MERGES = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    tokens = _byte_tokens()
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    n_regular = n_vocab - len(SPECIALS)
    if n_regular < len(tokens):
        raise ValueError(f"n_vocab must be at least {len(tokens) + len(SPECIALS)}")
    tokens += [f"<unused{i}>" for i in range(n_regular - len(tokens))]
    types = [1] * len(tokens)  # NORMAL
    tokens += SPECIALS
    types += [3] * len(SPECIALS)  # CONTROL
    return tokens, types


def _expert_tensors(p: str, w, n_embd: int, n_expert: int, n_ff_exp: int) -> dict[str, np.ndarray]:
    """A mixture-of-experts FFN: the router (kept F32, as llama.cpp's quantizer keeps it) and the
    experts stacked on a third axis (numpy (n_expert, rows, cols) = ggml's (cols, rows, n_expert))."""
    return {
        p + "ffn_gate_inp.weight": w(n_expert, n_embd) * 8,  # wide router logits: decisive routing
        p + "ffn_gate_exps.weight": w(n_expert, n_ff_exp, n_embd),
        p + "ffn_up_exps.weight": w(n_expert, n_ff_exp, n_embd),
        p + "ffn_down_exps.weight": w(n_expert, n_embd, n_ff_exp),
    }


@dataclass(frozen=True)
class GemmaParams:
    """Gemma 3 settings of a tiny model."""

    n_swa: int = 4  # attention.sliding_window (0: no key, every layer global)
    swa_pattern: int | list[bool] | None = 3  # every n-th layer global, or one bool per layer (True = local); None: no key (llama.cpp: 6)
    head_dim: int | None = 32  # attention.key_length/value_length, unlike n_embd / n_head; None: n_embd / n_head
    rope_freq_base_swa: float | None = None  # None: no key (llama.cpp: 10000)
    final_logit_softcapping: float | None = None


def _add_gemma_metadata(writer, g: GemmaParams) -> None:
    if g.n_swa:
        writer.add_sliding_window(g.n_swa)
    if isinstance(g.swa_pattern, int):
        writer.add_uint32(f"{writer.arch}.attention.sliding_window_pattern", g.swa_pattern)
    elif g.swa_pattern is not None:
        writer.add_sliding_window_pattern(g.swa_pattern)
    if g.rope_freq_base_swa is not None:
        writer.add_rope_freq_base_swa(g.rope_freq_base_swa)
    if g.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(g.final_logit_softcapping)


def write_tiny_model(path, arch: str = "llama", n_layer: int = 4, n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, n_vocab: int = 300, seed: int = 0,
                     n_ctx_train: int = 512, rope_freq_base: float = 10000.0, rms_eps: float = 1e-5,
                     tied_output: bool = False, omit_tensors: tuple[str, ...] = (), scale: float = 0.08,
                     weight_type: str = "f32", arch_name: str | None = None,
                     rope_scaling: tuple[str, float] | None = None, rope_orig_ctx: int | None = None,
                     head_dim: int | None = None, n_expert: int = 0, n_expert_used: int = 2,
                     n_ff_exp: int | None = None, gemma: "GemmaParams | None" = None, spm: bool = False) -> Path:
    """Write a random-weight model and return its path.

    `omit_tensors` drops tensors (for error tests). `weight_type` ("f32", "f16", "q8_0", "q4_0")
    stores the matrices of the layers and the LM head in that type, so quantized code paths
    (ggml's CPU_REPACK buffers) can be tested without a download. `arch_name` writes another
    `general.architecture` with the `arch` layout (to test an unsupported architecture).
    `rope_scaling=("linear"|"yarn", factor)` and `rope_orig_ctx` write RoPE scaling metadata.
    `head_dim` writes attention.key_length/value_length with Q/K/V heads of that size (Qwen3's heads
    are wider than n_embd / n_head); qwen3 and qwen3moe add the per-head Q and K norms.
    `n_expert` > 0 writes mixture-of-experts layers (qwen3moe, or llama: Mixtral-style): a router
    `ffn_gate_inp` and stacked `ffn_{gate,up,down}_exps` in place of the dense FFN, `n_expert_used`
    experts per token, each `n_ff_exp` wide (qwen3moe's expert_feed_forward_length; llama: n_ff).
    `arch="gemma3"` writes Gemma 3's layout (Q/K norms, post-norms, tied output) with `gemma`'s
    sliding-window settings (default `GemmaParams()`).
    `spm=True` writes a SentencePiece vocabulary (byte fallback, a space added in front of the text,
    as Llama 2's) in place of the byte-level BPE one.
    """
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    if arch == "qwen3moe" and not n_expert:
        raise ValueError("qwen3moe needs n_expert > 0")
    n_ff_exp = (n_ff_exp or n_ff) if arch == "qwen3moe" else n_ff
    if arch == "gemma3":
        gemma = gemma or GemmaParams()
        tied_output = True
        head_dim = head_dim or gemma.head_dim
    explicit_head_dim = head_dim is not None
    head_dim = head_dim or n_embd // n_head
    n_embd_q = head_dim * n_head
    n_embd_kv = head_dim * n_head_kv

    def w(*shape):  # numpy shape is (rows, cols) = ggml's (ne1, ne0)
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": w(n_vocab, n_embd)}
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(n_embd)
        tensors[p + "attn_q.weight"] = w(n_embd_q, n_embd)
        tensors[p + "attn_k.weight"] = w(n_embd_kv, n_embd)
        tensors[p + "attn_v.weight"] = w(n_embd_kv, n_embd)
        if arch == "qwen2":
            tensors[p + "attn_q.bias"] = w(n_embd_q)
            tensors[p + "attn_k.bias"] = w(n_embd_kv)
            tensors[p + "attn_v.bias"] = w(n_embd_kv)
        tensors[p + "attn_output.weight"] = w(n_embd, n_embd_q)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            tensors[p + "attn_q_norm.weight"] = norm(head_dim)
            tensors[p + "attn_k_norm.weight"] = norm(head_dim)
        tensors[p + "ffn_norm.weight"] = norm(n_embd)
        if n_expert:
            tensors.update(_expert_tensors(p, w, n_embd, n_expert, n_ff_exp))
        else:
            tensors[p + "ffn_gate.weight"] = w(n_ff, n_embd)
            tensors[p + "ffn_up.weight"] = w(n_ff, n_embd)
            tensors[p + "ffn_down.weight"] = w(n_embd, n_ff)
        if arch == "gemma3":
            tensors[p + "post_attention_norm.weight"] = norm(n_embd)
            tensors[p + "post_ffw_norm.weight"] = norm(n_embd)
    tensors["output_norm.weight"] = norm(n_embd)
    if not tied_output:
        tensors["output.weight"] = w(n_vocab, n_embd)

    matrix_suffixes = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                       "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "_exps.weight")
    qtype = {"f32": None, "f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[weight_type]

    def is_matrix(name: str) -> bool:
        return name == "output.weight" or name.endswith(matrix_suffixes)

    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_rope_freq_base(rope_freq_base)
    writer.add_rope_dimension_count(head_dim)
    if explicit_head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if n_expert:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(n_ff_exp)
    if rope_scaling is not None:
        kind, factor = rope_scaling
        writer.add_rope_scaling_type({"linear": gguf.RopeScalingType.LINEAR, "yarn": gguf.RopeScalingType.YARN}[kind])
        writer.add_rope_scaling_factor(factor)
    if rope_orig_ctx is not None:
        writer.add_rope_scaling_orig_ctx_len(rope_orig_ctx)
    if arch == "gemma3":
        _add_gemma_metadata(writer, gemma)
    if spm:
        _add_spm_vocab(writer, n_vocab)
    else:
        _add_bpe_vocab(writer, n_vocab)
    for name, data in tensors.items():
        if name in omit_tensors:
            continue
        if qtype is not None and is_matrix(name):
            if qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(name, data.astype(np.float16))
            else:
                writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_bpe_vocab(writer, n_vocab: int) -> None:
    tokens, types = vocab(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _add_spm_vocab(writer, n_vocab: int) -> None:
    """<unk>, <s>, </s>, the 256 byte tokens, then '▁'-prefixed pieces; llama.cpp adds a space in
    front of the text (add_space_prefix), so its tokens do not spell the text back exactly."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE
    words = ["\u2581", "\u2581t", "\u2581a", "he", "in", "\u2581the"]
    tokens += words + [f"<unused{i}>" for i in range(n_vocab - len(tokens) - len(words))]
    types += [1] * (n_vocab - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(n_vocab - 259)])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)

"""Structure-aware mutations of GGUF files (atheris custom mutator).

Three kinds, chosen at random for each input:
- field: overwrite one numeric field found by `gguf_struct.scan` (a count, a string or array
  length, a value type, a dimension, a tensor type or offset) with a boundary value;
- edit: change the parsed file and write it back: set a key the readers use to an odd value or
  type, delete or duplicate entries, resize arrays, change a tensor's shape, type, offset or name,
  the alignment, the version, the chat template, cut the data section;
- bytes: libFuzzer's own byte-level mutation (atheris.Mutate), and truncation at a field boundary.
"""

from __future__ import annotations

import functools
import random
import struct

from gguf_struct import (GGML_TYPE_SIZE, INT_TYPES, KV, SCALAR_FORMAT, T_ARRAY, T_BOOL, T_FLOAT32, T_FLOAT64,
                         T_INT32, T_STRING, T_UINT32, T_UINT64, Field, Gguf, TensorInfo, parse, relayout, scan)

BOUNDARY_INTS = [0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 255, 256, 4095, 4096, 65535, 65536, 1 << 20,
                 (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
                 -1, -2, -(1 << 31), -(1 << 63)]
BOUNDARY_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, float("inf"), float("-inf"), float("nan"), 0.5, 1e-5]
ODD_STRINGS = [b"", b"llama", b"qwen2", b"gpt2", b"bert", b"t5", b"rwkv", b"none", b"linear", b"yarn", b"default",
               b"qwen2", b"smollm", b"\xff\xfe", b"\xc3", b"a" * 300, b"<|im_end|>", b"\x00abc", "é".encode()]
TEMPLATES = [
    "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.content }}{% endfor %}", "{{ undefined_var.x }}",
    "{% if %}", "{{ raise_exception('template refuses') }}", "{{ messages[99]['content'] }}", "{{ 1/0 }}",
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}{% endfor %}{{ eos_token }}", "{% for x in 5 %}{% endfor %}",
    "{{ messages | length }}{{ '<|im_start|>' * 3 }}", "", "{{", "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
]
TENSOR_NAMES = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_q.weight",
                "blk.1.ffn_down.weight", "blk.99999.attn_q.weight", "rope_freqs.weight", "blk.0.attn_q.bias",
                "x" * 70, "", "blk.-1.attn_norm.weight"]


def known_keys(arch: str) -> list[str]:
    """The metadata keys pipeinfer's readers and llama.cpp's vocabulary loader look at."""
    a = arch + "."
    return ["general.architecture", "general.alignment", "general.name", "general.file_type",
            a + "block_count", a + "embedding_length", a + "feed_forward_length", a + "attention.head_count",
            a + "attention.head_count_kv", a + "context_length", a + "attention.layer_norm_rms_epsilon",
            a + "expert_count", a + "attention.key_length", a + "attention.value_length",
            a + "rope.dimension_count", a + "rope.freq_base", a + "rope.scaling.type", a + "rope.scaling.factor",
            a + "rope.scale_linear", a + "rope.scaling.original_context_length", a + "rope.scaling.attn_factor",
            "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template"]


def _odd_int(rng: random.Random, near: int | None = None) -> int:
    if near is not None and rng.random() < 0.4:
        return rng.choice([near - 1, near + 1, near * 2, near // 2, -near, near + rng.randint(-16, 16)])
    return rng.choice(BOUNDARY_INTS)


def _random_value(rng: random.Random, g: Gguf, old: KV | None) -> tuple[int, object]:
    """A (type, value) for a key: often the old type with an odd value, sometimes another type."""
    vtype = old.type if old is not None and rng.random() < 0.6 else rng.choice(
        [*INT_TYPES, T_FLOAT32, T_FLOAT64, T_BOOL, T_STRING, T_ARRAY, rng.randint(13, 40)])
    if vtype in INT_TYPES:
        near = old.value if old is not None and isinstance(old.value, int) else None
        return vtype, _odd_int(rng, near)
    if vtype in (T_FLOAT32, T_FLOAT64):
        return vtype, rng.choice(BOUNDARY_FLOATS)
    if vtype == T_BOOL:
        return vtype, rng.choice([0, 1, 2, 255])
    if vtype == T_STRING:
        return vtype, rng.choice(ODD_STRINGS + [t.encode() for t in TEMPLATES])
    if vtype == T_ARRAY:
        elem = rng.choice([T_INT32, T_UINT32, T_UINT64, T_STRING, T_FLOAT32])
        n = rng.choice([0, 1, 2, 3, len(g.tensors), 300])
        if elem == T_STRING:
            return vtype, (elem, [rng.choice(ODD_STRINGS) for _ in range(n)])
        if elem == T_FLOAT32:
            return vtype, (elem, [rng.choice(BOUNDARY_FLOATS) for _ in range(n)])
        v = _odd_int(rng)
        return vtype, (elem, [v if rng.random() < 0.8 else _odd_int(rng) for _ in range(n)])
    return vtype, 0  # an unknown type id: written without a payload


def _arch(g: Gguf) -> str:
    kv = g.get("general.architecture")
    return kv.value if kv is not None and isinstance(kv.value, str) else "llama"


def edit_set_key(g: Gguf, rng: random.Random) -> None:
    keys = known_keys(_arch(g))
    present = [kv.key for kv in g.kvs if kv.key in keys]
    key = rng.choice(present if present and rng.random() < 0.5 else keys)
    old = g.get(key)
    vtype, value = _random_value(rng, g, old)
    if key == "tokenizer.chat_template" and rng.random() < 0.7:
        vtype, value = T_STRING, rng.choice(TEMPLATES).encode()
    if old is not None:
        old.type, old.value = vtype, value
    else:
        g.kvs.insert(rng.randint(0, len(g.kvs)), KV(key, vtype, value))


def edit_kv_list(g: Gguf, rng: random.Random) -> None:
    if not g.kvs:
        return
    i = rng.randrange(len(g.kvs))
    if rng.random() < 0.5:
        del g.kvs[i]
    else:
        g.kvs.insert(rng.randint(0, len(g.kvs)), KV(g.kvs[i].key, g.kvs[i].type, g.kvs[i].value))


def edit_array(g: Gguf, rng: random.Random) -> None:
    arrays = [kv for kv in g.kvs if kv.type == T_ARRAY and isinstance(kv.value, tuple)]
    if not arrays:
        return
    kv = rng.choice(arrays)
    elem, items = kv.value
    items = list(items)
    r = rng.random()
    if r < 0.35:  # shrink or grow
        n = rng.choice([0, 1, len(items) // 2, max(0, len(items) - 1), len(items) + 1, len(items) * 2])
        items = (items * (n // max(1, len(items)) + 1))[:n] if items else [0 if elem != T_STRING else b""] * min(n, 8)
    elif r < 0.6 and items:  # one odd element
        j = rng.randrange(len(items))
        items[j] = rng.choice(ODD_STRINGS) if elem == T_STRING else (
            rng.choice(BOUNDARY_FLOATS) if elem in (T_FLOAT32, T_FLOAT64) else _odd_int(rng))
    elif r < 0.8:  # another element type, same items reinterpreted where possible
        new = rng.choice([t for t in (*INT_TYPES, T_FLOAT32, T_STRING, T_BOOL) if t != elem])
        items = [_convert(x, new) for x in items]
        elem = new
    else:  # duplicate entries (duplicate tokens / merges)
        if items:
            items.insert(rng.randrange(len(items) + 1), rng.choice(items))
    kv.value = (elem, items)


def _convert(x, vtype: int):
    if vtype == T_STRING:
        return str(x).encode() if not isinstance(x, bytes) else x
    if isinstance(x, bytes):
        return len(x)
    return x if vtype not in SCALAR_FORMAT or SCALAR_FORMAT[vtype][-1] not in "fd" else float(x)


def edit_tensor(g: Gguf, rng: random.Random) -> None:
    if not g.tensors:
        return
    t = rng.choice(g.tensors)
    r = rng.random()
    if r < 0.3:  # shape
        if rng.random() < 0.2 or not t.ne:
            t.ne = t.ne[:rng.randint(0, 5)] + [1] * rng.randint(0, 2)
        else:
            d = rng.randrange(len(t.ne))
            t.ne[d] = _odd_int(rng, t.ne[d])
        if rng.random() < 0.5:
            relayout(g)
    elif r < 0.5:  # type
        t.type = rng.choice(list(GGML_TYPE_SIZE) + [4, 5, 9, 39, 40, 41, 1000, (1 << 32) - 1])
        if rng.random() < 0.5:
            relayout(g)
    elif r < 0.7:  # offset
        other = rng.choice(g.tensors).offset
        t.offset = rng.choice([0, t.offset + 1, t.offset + 16, other, len(g.data), len(g.data) - 1,
                               _odd_int(rng, t.offset)]) & ((1 << 64) - 1)
    elif r < 0.8:
        g.tensors.remove(t)
    elif r < 0.9:
        g.tensors.insert(rng.randint(0, len(g.tensors)), TensorInfo(t.name, list(t.ne), t.type, t.offset))
    else:
        t.name = rng.choice(TENSOR_NAMES)


def edit_layout(g: Gguf, rng: random.Random) -> None:
    r = rng.random()
    if r < 0.4:
        old = g.get("general.alignment")
        value = rng.choice([0, 1, 2, 3, 7, 8, 16, 64, 4096, 1 << 31, (1 << 32) - 1])
        vtype = rng.choice([T_UINT32, T_UINT32, T_UINT64, T_INT32])
        if old is None:
            g.kvs.append(KV("general.alignment", vtype, value))
        else:
            old.type, old.value = vtype, value
        if rng.random() < 0.5:
            relayout(g)
    elif r < 0.6:
        g.version = rng.choice([0, 1, 2, 3, 4, (1 << 32) - 1])
    else:
        g.data = g.data[:rng.randint(0, len(g.data))] if rng.random() < 0.8 else g.data + bytes(rng.randint(1, 64))


EDITS = [(edit_set_key, 5), (edit_kv_list, 1), (edit_array, 3), (edit_tensor, 4), (edit_layout, 2)]

FIELD_WEIGHTS = {"n_tensors": 3, "n_kv": 3, "str_len": 2, "kv_type": 3, "arr_type": 3, "arr_len": 4, "value": 2,
                 "n_dims": 4, "ne": 4, "tensor_type": 3, "tensor_offset": 3, "version": 1}


# libFuzzer mutates the same corpus entries again and again. Walking an entry's header (a
# 49,152-token vocabulary in the SmolLM2 seeds) took about half of the fuzzing process's time, so
# each entry is walked once; the edits work on a copy.
@functools.lru_cache(maxsize=128)
def _fields(data: bytes) -> tuple[Field, ...]:
    return tuple(scan(data))


@functools.lru_cache(maxsize=128)
def _parsed(data: bytes) -> Gguf | None:
    return parse(data)


def mutate_field(data: bytes, rng: random.Random) -> bytes | None:
    fields = _fields(data)
    if not fields:
        return None
    f: Field = rng.choices(fields, weights=[FIELD_WEIGHTS.get(x.kind, 1) for x in fields])[0]
    old = data[f.offset:f.offset + f.width]
    if f.is_float:
        fmt = "<f" if f.width == 4 else "<d"
        new = struct.pack(fmt, rng.choice(BOUNDARY_FLOATS))
    else:
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[f.width]
        near = struct.unpack(fmt, old)[0]
        new = struct.pack(fmt, _odd_int(rng, near) & ((1 << (8 * f.width)) - 1))
    return data[:f.offset] + new + data[f.offset + f.width:]


def truncate_at_field(data: bytes, rng: random.Random) -> bytes | None:
    fields = _fields(data)
    if not fields:
        return data[:rng.randint(0, len(data))]
    f = rng.choice(fields)
    cut = f.offset + rng.choice([0, 1, f.width - 1, f.width, f.width + 1])
    return data[:max(0, cut)]


def mutate(data: bytes, max_size: int, seed: int, byte_mutate=None) -> bytes:
    """One mutation of data, at most max_size bytes; byte_mutate is atheris.Mutate when fuzzing."""
    rng = random.Random(seed)
    r = rng.random()
    out = None
    if r < 0.35:
        out = mutate_field(data, rng)
    elif r < 0.75:
        g = _parsed(data)
        if g is not None:
            g = g.copy()
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                fn = rng.choices([e for e, _ in EDITS], weights=[w for _, w in EDITS])[0]
                fn(g, rng)
            out = g.to_bytes()
    elif r < 0.85:
        out = truncate_at_field(data, rng)
    if out is None:
        out = byte_mutate(data, max_size) if byte_mutate is not None else bytes(
            b ^ (rng.randrange(256) if rng.random() < 0.01 else 0) for b in data)
    return out[:max_size]

"""Reading a GGUF file's metadata and tensor table, for `inspect` and planning.

The read is the native extension's (`_native.gguf_metadata`): the same ggml reader and the same
checks as the layer engine's loader, without the tensor data. The `gguf` Python package would parse
every element of every array field, which is slow on a large vocabulary; ggml's reader skips what it
is not asked for (BENCHMARKS.md, "Figures formerly quoted in source comments").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

from ..errors import ModelFileError
from .model_files import check_gguf_file

_BLOCK = re.compile(r"^blk\.(\d+)\.")
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: no model it loads has more
_UINT32_MAX = (1 << 32) - 1


@dataclass
class ModelInfo:
    """What `pipeinfer inspect` shows; all sizes in bytes."""

    path: str
    file_size: int
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    rope_freq_base: float | None
    n_vocab: int
    tokenizer_model: str
    tokenizer_pre: str
    chat_template: bool
    file_type: str
    tensor_types: dict[str, int]  # ggml type name -> number of tensors
    n_tensors: int
    layer_bytes: list[int]  # bytes of the weights of each layer
    expert_bytes: list[int]  # of layer_bytes, the mixture-of-experts matrices (ffn_*_exps) of each layer
    token_embd_bytes: int
    output_bytes: int  # LM head (the tied token_embd when there is no output.weight)
    output_tied: bool
    other_bytes: int  # output_norm and anything else outside the layers
    n_expert: int = 0  # experts per layer (0: dense)
    n_expert_used: int = 0  # experts each token is routed to
    n_ff_exp: int = 0  # width of one expert's FFN
    n_embd_head: int = 0  # head size of K and V (attention.key_length, else n_embd / n_head)

    @property
    def kv_bytes_per_cell(self) -> int:
        """K and V of one layer for one KV cell, f16 as the engine allocates them (native/src/kv_cache.cpp)."""
        return 2 * 2 * self.n_head_kv * self.n_embd_head

    def to_dict(self) -> dict:
        return asdict(self)


def read_model_info(path: Path) -> ModelInfo:
    """Parse the header and tensor table; a truncated or malformed file raises ModelFileError."""
    from .. import _native

    path = Path(path)
    check_gguf_file(path)
    try:
        meta = _native.gguf_metadata(str(path))
    except _native.ModelFileError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise ModelFileError(f"{path} is not a readable GGUF file ({reason}); the file may be truncated, download it again") from None
    file_size, kv, tensors = meta["file_size"], meta["kv"], meta["tensors"]
    end = max((off + n for _, _, off, n in tensors), default=0)
    if end > file_size:
        raise ModelFileError(f"{path} is truncated: its tensors need {end} bytes but the file has {file_size}; download it again")
    arch = kv.get("general.architecture", "")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{path} has no general.architecture; it is not a model file")

    n_layer = _count(path, kv, f"{arch}.block_count", 0)
    if n_layer > MAX_LAYERS:
        raise ModelFileError(f"{path} declares {n_layer} layers ({arch}.block_count), more than the {MAX_LAYERS} "
                             "llama.cpp supports; the file is corrupted")
    sizes = _tensor_bytes(tensors, n_layer)
    return ModelInfo(path=str(path), file_size=file_size, arch=arch, n_layer=n_layer, **_hparams(path, kv, arch),
                     file_type=_file_type_name(kv.get("general.file_type", None)), **sizes)


_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.")


class _TensorSizes(TypedDict):
    """ModelInfo's fields that the tensor table gives."""

    tensor_types: dict[str, int]
    n_tensors: int
    layer_bytes: list[int]
    expert_bytes: list[int]
    token_embd_bytes: int
    output_bytes: int
    output_tied: bool
    other_bytes: int


def _tensor_bytes(tensors, n_layer: int) -> _TensorSizes:
    """Bytes per layer (and of its experts), of token_embd, of the LM head (tied to token_embd when
    absent) and the rest."""
    layer_bytes = [0] * n_layer
    expert_bytes = [0] * n_layer
    types: Counter[str] = Counter()
    token_embd = output = other = 0
    has_output = False
    for name, type_name, _, n_bytes in tensors:
        types[type_name] += 1
        m = _BLOCK.match(name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += n_bytes
            if _EXPERTS.match(name):
                expert_bytes[int(m.group(1))] += n_bytes
        elif name == "token_embd.weight":
            token_embd = n_bytes
        elif name == "output.weight":
            output, has_output = n_bytes, True
        else:
            other += n_bytes
    return {"tensor_types": dict(sorted(types.items())), "n_tensors": len(tensors), "layer_bytes": layer_bytes,
            "expert_bytes": expert_bytes,
            "token_embd_bytes": token_embd, "output_bytes": output if has_output else token_embd,
            "output_tied": not has_output, "other_bytes": other}


def _file_type_name(file_type) -> str:
    import gguf  # only for the names of the file-type enum

    try:
        return gguf.LlamaFileType(file_type).name if file_type is not None else "unknown"
    except ValueError:
        return str(file_type)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(path: Path, kv: dict, key: str, default: int) -> int:
    """An integer hyperparameter (an array counts as its length, as gguf_metadata gives it), 0..2^32-1."""
    v = kv.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _UINT32_MAX:
        raise ModelFileError(f"{path}: metadata key '{key}' is {_short(v)}, not a count (an integer from 0 to {_UINT32_MAX}); "
                             "the file is corrupted")
    return v


class _Experts(TypedDict, total=False):
    """ModelInfo's mixture-of-experts fields (none for a dense model)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int


class _HParams(_Experts):
    """ModelInfo's fields that the metadata gives."""

    name: str
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_head: int
    n_ff: int
    n_ctx_train: int
    rope_freq_base: float | None
    n_vocab: int
    tokenizer_model: str
    tokenizer_pre: str
    chat_template: bool


def _hparams(path: Path, kv: dict, arch: str) -> _HParams:
    def count(key: str, default: int = 0) -> int:
        return _count(path, kv, f"{arch}.{key}", default)

    freq_base = kv.get(f"{arch}.rope.freq_base")
    if freq_base is not None and (isinstance(freq_base, (bool, str)) or not math.isfinite(freq_base)):
        raise ModelFileError(f"{path}: metadata key '{arch}.rope.freq_base' is {_short(freq_base)}, not a finite number; "
                             "the file is corrupted")
    return {
        "name": str(kv.get("general.name", "")),
        "n_embd": count("embedding_length"),
        "n_head": count("attention.head_count"),
        "n_head_kv": count("attention.head_count_kv", count("attention.head_count")),
        "n_embd_head": count("attention.key_length", count("embedding_length") // max(1, count("attention.head_count"))),
        "n_ff": count("feed_forward_length"),
        "n_ctx_train": count("context_length"),
        "rope_freq_base": None if freq_base is None else float(freq_base),
        "n_vocab": _count(path, kv, "tokenizer.ggml.tokens", 0),
        "tokenizer_model": str(kv.get("tokenizer.ggml.model", "")),
        "tokenizer_pre": str(kv.get("tokenizer.ggml.pre", "")),
        "chat_template": kv.get("tokenizer.chat_template") is not None,
        **_experts(count, arch),
    }


def _experts(count, arch: str) -> _Experts:
    """Mixture-of-experts sizes, resolved as the native loader resolves them (model_loader.cpp:
    llama's experts are feed_forward_length wide, qwen3moe's expert_feed_forward_length).
    count(key, default) reads the architecture's integer key, refusing a value that is not one."""
    n_expert = count("expert_count")
    if not n_expert:
        return {}
    n_used = count("expert_used_count")
    n_ff = count("feed_forward_length")
    n_ff_exp = n_ff if arch == "llama" else count("expert_feed_forward_length", n_ff // max(n_used, 1))
    return {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp}

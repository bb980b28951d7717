"""Reading a GGUF file's metadata and tensor table (ggml's reader, see gguf_c.py), for `inspect` and planning."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ModelFileError
from .layer_split import balanced_split, fractions_of
from .model_files import check_gguf_file

_BLOCK = re.compile(r"^blk\.(\d+)\.")


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
    token_embd_bytes: int
    output_bytes: int  # LM head (the tied token_embd when there is no output.weight)
    output_tied: bool
    other_bytes: int  # output_norm and anything else outside the layers
    split: list[dict] = field(default_factory=list)  # default layer split, filled by with_split()

    def with_split(self, n_ranks: int) -> "ModelInfo":
        ranges = balanced_split(self.layer_bytes, n_ranks, last_extra=self.output_bytes)
        fr = fractions_of(ranges, self.n_layer)
        self.split = []
        for rank, ((b, e), f) in enumerate(zip(ranges, fr)):
            weights = sum(self.layer_bytes[b:e])
            if rank == 0:
                weights += self.token_embd_bytes
            if rank == len(ranges) - 1:
                weights += self.other_bytes + (0 if self.output_tied and rank == 0 else self.output_bytes)
            self.split.append({"rank": rank, "layers": [b, e], "n_layers": e - b, "fraction": f, "weight_bytes": weights})
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def read_model_info(path: Path) -> ModelInfo:
    """Parse the header and tensor table; a truncated or malformed file raises ModelFileError."""
    import gguf  # only for the names of the file-type enum

    from .gguf_c import GGUFFile

    path = Path(path)
    check_gguf_file(path)
    file_size = path.stat().st_size
    try:
        reader = GGUFFile(path)
    except ValueError as e:
        raise ModelFileError(f"{path} is not a readable GGUF file ({e}); the file may be truncated, download it again") from None
    with reader:
        tensors = reader.tensors()
        end = max((off + n for _, _, off, n in tensors), default=0)
        if end > file_size:
            raise ModelFileError(f"{path} is truncated: its tensors need {end} bytes but the file has {file_size}; download it again")
        arch = reader.get("general.architecture", "")
        if not arch:
            raise ModelFileError(f"{path} has no general.architecture; it is not a model file")

        def hp(key: str, default=0):
            return reader.get(f"{arch}.{key}", default)

        n_layer = int(hp("block_count"))
        layer_bytes = [0] * n_layer
        types: Counter[str] = Counter()
        token_embd = output = other = 0
        has_output = False
        for name, type_name, _, n_bytes in tensors:
            types[type_name] += 1
            m = _BLOCK.match(name)
            if m and int(m.group(1)) < n_layer:
                layer_bytes[int(m.group(1))] += n_bytes
            elif name == "token_embd.weight":
                token_embd = n_bytes
            elif name == "output.weight":
                output, has_output = n_bytes, True
            else:
                other += n_bytes
        file_type = reader.get("general.file_type", None)
        try:
            file_type_name = gguf.LlamaFileType(file_type).name if file_type is not None else "unknown"
        except ValueError:
            file_type_name = str(file_type)
        fields = {
            "name": str(reader.get("general.name", "")),
            "n_embd": int(hp("embedding_length")),
            "n_head": int(hp("attention.head_count")),
            "n_head_kv": int(hp("attention.head_count_kv", hp("attention.head_count"))),
            "n_ff": int(hp("feed_forward_length")),
            "n_ctx_train": int(hp("context_length")),
            "rope_freq_base": (float(v) if (v := hp("rope.freq_base", None)) is not None else None),
            "n_vocab": int(reader.get("tokenizer.ggml.tokens", 0)),
            "tokenizer_model": str(reader.get("tokenizer.ggml.model", "")),
            "tokenizer_pre": str(reader.get("tokenizer.ggml.pre", "")),
            "chat_template": reader.get("tokenizer.chat_template") is not None,
        }
    return ModelInfo(
        path=str(path),
        file_size=file_size,
        arch=arch,
        n_layer=n_layer,
        **fields,
        file_type=file_type_name,
        tensor_types=dict(sorted(types.items())),
        n_tensors=len(tensors),
        layer_bytes=layer_bytes,
        token_embd_bytes=token_embd,
        output_bytes=output if has_output else token_embd,
        output_tied=not has_output,
        other_bytes=other,
    )

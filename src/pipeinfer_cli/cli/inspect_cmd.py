"""`pipeinfer inspect MODEL`: a GGUF's hyperparameters, tensor types, bytes per layer and default split."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..gguf_info import read_model_info
from ..model_files import resolve_model
from ..registry import load_registry
from .console import human_bytes, out
from .options import JsonFlag, RanksOption


def inspect(
    model: Annotated[str, typer.Argument(help="Registry name (see `pipeinfer models list`) or path to a .gguf file.")],
    ranks: RanksOption = 2,
    as_json: JsonFlag = False,
) -> None:
    """Show a model's architecture, tensors and bytes per layer, and how its layers split over ranks.

    The default split gives each rank consecutive layers so that the largest stage holds as few
    bytes of weights as possible (the last stage also computes the LM head).
    """
    ref = resolve_model(model, load_registry())
    info = read_model_info(ref.path).with_split(ranks)
    if as_json:
        out.print_json(json.dumps({"model": ref.label, **info.to_dict()}))
        return
    t = Table(title=f"{ref.label}  ({info.path})", title_justify="left", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rows = [
        ("architecture", info.arch),
        ("name", info.name),
        ("file type", info.file_type),
        ("file size", human_bytes(info.file_size)),
        ("layers", str(info.n_layer)),
        ("n_embd", str(info.n_embd)),
        ("heads / KV heads", f"{info.n_head} / {info.n_head_kv}"),
        ("n_ff", str(info.n_ff)),
        ("context length", str(info.n_ctx_train)),
        ("rope freq base", "-" if info.rope_freq_base is None else f"{info.rope_freq_base:g}"),
        ("vocabulary", f"{info.n_vocab} ({info.tokenizer_model}, pre {info.tokenizer_pre or '-'})"),
        ("chat template", "yes" if info.chat_template else "no"),
        ("tensors", f"{info.n_tensors}: " + ", ".join(f"{k} ×{v}" for k, v in info.tensor_types.items())),
        ("token_embd", human_bytes(info.token_embd_bytes)),
        ("LM head", human_bytes(info.output_bytes) + (" (tied to token_embd)" if info.output_tied else "")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    lt = Table(title="bytes per layer", title_justify="left")
    lt.add_column("layers")
    lt.add_column("bytes each", justify="right")
    # Consecutive layers of equal size are shown as one row, to keep 28-layer models readable.
    start = 0
    for i in range(1, info.n_layer + 1):
        if i == info.n_layer or info.layer_bytes[i] != info.layer_bytes[start]:
            label = f"{start}" if i - 1 == start else f"{start}–{i - 1}"
            lt.add_row(label, human_bytes(info.layer_bytes[start]))
            start = i
    out.print(lt)
    st = Table(title=f"default layer split for {ranks} rank(s) (balanced by bytes)", title_justify="left")
    for col in ("rank", "layers", "fraction", "weights"):
        st.add_column(col, justify="right")
    for s in info.split:
        st.add_row(str(s["rank"]), f"[{s['layers'][0]}, {s['layers'][1]})", f"{s['fraction']:.3f}", human_bytes(s["weight_bytes"]))
    out.print(st)

"""`pipeinfer inspect MODEL`: a GGUF's hyperparameters, tensor types, bytes per layer and default split."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..planner.layout import parse_layer_split, plan_split
from ..errors import UsageError
from ..models.gguf_info import read_model_info
from ..models.model_files import resolve_model
from ..models.registry import load_registry
from .console import out
from ..decode.draft_spec import DraftSpec
from .draft_spec import parse_draft
from .options import JsonFlag, LayerSplitOption
from .wording import human_bytes, plural


InspectRanksOption = Annotated[int | None, typer.Option(
    "--ranks", "-r", min=1, help="Ranks to plan for (default: 2, or the ranks --layer-split describes).")]
InspectDraftOption = Annotated[str | None, typer.Option(
    "--draft", "-md", help="Draft model (name or .gguf path) or 'lookup', to plan with it: a draft on the head gets the head fewer layers.")]


def _draft_bytes(draft: DraftSpec, reg) -> tuple[DraftSpec, int]:
    """(the draft, its model resolved; bytes of weights); a registry model need not be downloaded."""
    from ..models.model_files import looks_like_path

    if not draft.uses_model:
        return draft, 0
    if draft.model in reg.models and not looks_like_path(draft.model):
        return draft, reg.models[draft.model].size
    ref = resolve_model(draft.model, reg)
    return draft.resolved(ref.label), ref.path.stat().st_size


def inspect(
    model: Annotated[str, typer.Argument(help="Registry name or pair (see `pipeinfer models list`), or path to a .gguf file.")],
    ranks: InspectRanksOption = None,
    draft: InspectDraftOption = None,
    layer_split: LayerSplitOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a model's architecture, tensors and bytes per layer, and how its layers split over ranks.

    The split is the one `generate` would use with the same --ranks, --layer-split and --draft (a pair name brings its draft): by default each rank gets consecutive layers so that the stage reading the most bytes of weights per token reads as few as possible. For a mixture-of-experts model the layer bytes count every expert (a stage holds them all), so the split balances memory too; the summary shows the experts, the experts used per token and the expert bytes per layer. The last stage also reads the LM head, the head also runs a draft model unless the split has a draft rank ('/1'). The head's token embedding table is shown apart: it is a lookup, one row per token, so it takes memory but next to no time.
    """
    reg = load_registry()
    spec = parse_draft(draft)
    if model in reg.pairs:
        pair = reg.pairs[model]
        model, spec = pair.target, spec or parse_draft(pair.draft)
    ref = resolve_model(model, reg)
    spec, draft_bytes = _draft_bytes(spec, reg)
    draft_label = spec.label
    if layer_split:
        fractions, n_draft_ranks = parse_layer_split(layer_split)
        if fractions is None:
            raise UsageError("inspect shows splits from the GGUF header alone; --layer-split auto comes from measured "
                             "times: see it with `pipeinfer plan MODEL --profile FILE --layer-split auto`")
        split_ranks = len(fractions) + n_draft_ranks
        if ranks is not None and ranks != split_ranks:
            raise UsageError(f"--layer-split {layer_split!r} describes {plural(split_ranks, 'rank')} but --ranks is {ranks}")
        if n_draft_ranks and not spec.uses_model:
            raise UsageError(f"--layer-split {layer_split!r} has a draft rank ('/1'), which needs a draft model: pass --draft MODEL")
        ranks = split_ranks
    info = read_model_info(ref.path)
    split = plan_split(info, ranks or 2, layer_split, draft_bytes)
    if as_json:
        out.print_json(json.dumps({"model": ref.label, "draft": draft_label, **info.to_dict(),
                                   "split": split.ranks, "layer_split": split.layer_split}))
        return
    out.print(_summary_table(ref.label, info))
    out.print(_layer_bytes_table(info))
    _print_split(info, split, layer_split, draft_label)


def _summary_table(label: str, info) -> Table:
    t = Table(title=f"{label}  ({info.path})", title_justify="left", show_header=False)
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
        *_expert_rows(info),
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
    return t


def _expert_rows(info) -> list[tuple[str, str]]:
    """Mixture-of-experts facts; none for a dense model."""
    if not info.n_expert:
        return []
    experts = sum(info.expert_bytes)
    return [("experts", f"{info.n_expert} per layer, {info.n_expert_used} used per token, n_ff {info.n_ff_exp} each"),
            ("expert weights", f"{human_bytes(experts)} ({100 * experts / max(sum(info.layer_bytes), 1):.0f} % of the "
                               f"layers); a token reads {info.n_expert_used}/{info.n_expert} of them")]


def _layer_bytes_table(info) -> Table:
    lt = Table(title="bytes per layer", title_justify="left")
    lt.add_column("layers")
    lt.add_column("bytes each", justify="right")
    moe = bool(info.n_expert)
    if moe:
        lt.add_column("of which experts", justify="right")
    # Consecutive layers of equal size are shown as one row, to keep 28-layer models readable.
    start = 0
    for i in range(1, info.n_layer + 1):
        if i == info.n_layer or (info.layer_bytes[i], info.expert_bytes[i]) != (info.layer_bytes[start],
                                                                                info.expert_bytes[start]):
            label = f"{start}" if i - 1 == start else f"{start}–{i - 1}"
            cells = [human_bytes(info.layer_bytes[start])] + ([human_bytes(info.expert_bytes[start])] if moe else [])
            lt.add_row(label, *cells)
            start = i
    return lt


def _print_split(info, split, layer_split: str | None, draft_label: str | None) -> None:
    how = f"--layer-split {layer_split}" if layer_split else "balanced by bytes read per token"
    draft_note = f", draft {draft_label}" if draft_label else ""
    st = Table(title=f"layer split for {plural(len(split.ranks), 'rank')}: {split.layer_split} ({how}{draft_note})",
               title_justify="left", box=None, pad_edge=False, header_style="bold underline")
    # "per token" = layers + LM head + draft: the bytes of weights a rank reads for each token, which
    # the default split balances. token_embd is held, not read (one row per token).
    for col in ("rank", "role", "layers", "weights", "LM head", "draft", "per token", "token_embd"):
        st.add_column(col, justify="left" if col in ("role", "layers") else "right", no_wrap=True)

    def size(n: int) -> str:
        return human_bytes(n) if n else "-"

    for r in split.ranks:
        b, e = r["layers"]
        layers = "-" if r["role"] == "draft" else (f"{b}–{e - 1} ({e - b})" if e - b > 1 else f"{b} (1)")
        st.add_row(str(r["rank"]), r["role"], layers, size(r["layer_bytes"]), size(r["lm_head_bytes"]),
                   size(r["draft_bytes"]), human_bytes(r["per_token_bytes"]), size(r["token_embd_bytes"]))
    out.print(st)
    tied = "; as the tied LM head, the last stage reads all of it" if info.output_tied else ""
    out.print(f"token_embd ({human_bytes(info.token_embd_bytes)}, on the head) is a lookup table: one row is read "
              f"per token, so it is left out of the balance{tied}.", markup=False, highlight=False)
    if info.n_expert:
        out.print(f"Layer bytes include all {info.n_expert} experts of each layer: a stage must hold them all, so the "
                  "split balances memory as well as the bytes read per token.", markup=False, highlight=False)

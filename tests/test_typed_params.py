"""A reader knows a value's shape from its signature: the parameters that carry the job's big
values are annotated everywhere, and the policies and the runtime read real fields, not
`getattr(x, "name", default)` stand-ins for them."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pipeinfer_cli"

# The job's configuration, a request, speculation settings, a drafter, a pipeline, the wire, a
# rank's loaded state: each has one type (JobConfig, Request, DecodeOptions, Drafter/AsyncDrafter,
# PipelineLike, Link, Loaded).
TYPED_NAMES = {"cfg", "req", "opts", "drafter", "pipe", "link", "loaded"}

# Functions whose parameters are still bare because their modules are being rewritten elsewhere;
# "module:function:parameter". Empty this as those modules are annotated.
PENDING_PARAMS: set[str] = set()

# Where a getattr with a default is the honest reading: the attribute is an optional capability of
# some implementations of a protocol, or any exception's. "module:attribute" -> why.
GETATTR_PACKAGES = ("decode", "runtime", "planner", "transport")
ALLOWED_GETATTR = {
    "decode/pipeinfer.py:free_draft": "a hybrid drafter alone offers lookup's free drafts beside a draft rank's",
    "decode/pipeinfer.py:clock": "a simulated pipeline keeps virtual time; the real one runs on the wall clock",
    "decode/pipeline_protocol.py:may_speculate": "only a parallel server's slot pipelines have a load policy",
    "decode/translated.py:close": "a text codec may hold nothing to free (a tokenizer loaded for the draft does)",
    "runtime/calibrate.py:exit_code": "any exception a rank raises is reported; some carry their exit status",
    "runtime/job.py:exit_code": "any exception a rank raises is reported; some carry their exit status",
}


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text())


def _bare_params(root: Path = SRC) -> set[str]:
    out = set()
    for rel, tree in _modules(root):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    if arg.arg in TYPED_NAMES and arg.annotation is None:
                        out.add(f"{rel}:{node.name}:{arg.arg}")
    return out


def _getattr_defaults(root: Path = SRC) -> set[str]:
    out = set()
    for rel, tree in _modules(root):
        if rel.split("/")[0] not in GETATTR_PACKAGES:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)):
                out.add(f"{rel}:{node.args[1].value}")
    return out


def test_the_big_values_are_typed_in_every_signature():
    bare = _bare_params() - PENDING_PARAMS
    assert not bare, f"annotate these parameters: {sorted(bare)}"


def test_no_getattr_stands_in_for_a_field():
    found = _getattr_defaults() - set(ALLOWED_GETATTR)
    assert not found, f"read a real field (give the type one with a default) instead of getattr: {sorted(found)}"


def test_the_exceptions_are_still_needed():
    """An entry that no longer matches anything is removed, so the lists only name what is left."""
    assert not PENDING_PARAMS - _bare_params(), sorted(PENDING_PARAMS - _bare_params())
    assert not set(ALLOWED_GETATTR) - _getattr_defaults(), sorted(set(ALLOWED_GETATTR) - _getattr_defaults())


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """The scan itself: a bare `cfg` and a getattr stand-in in a policy are found, an annotated
    parameter, a two-argument getattr and a front end's getattr are not."""
    (tmp_path / "decode").mkdir()
    (tmp_path / "cli").mkdir()
    code = "def f(cfg, opts: int, *, pipe=None):\n    return getattr(cfg, 'profile', None), getattr(cfg, 'n_ctx')\n"
    (tmp_path / "decode" / "m.py").write_text(code)
    (tmp_path / "cli" / "c.py").write_text(code)
    assert _bare_params(tmp_path) == {"decode/m.py:f:cfg", "decode/m.py:f:pipe", "cli/c.py:f:cfg", "cli/c.py:f:pipe"}
    assert _getattr_defaults(tmp_path) == {"decode/m.py:profile"}

"""No function of the policies (decode/), the runtime or the planner returns a bare `dict`: a value's
shape is in its type (a dataclass, or a mapping typed key -> value). A dict that is the JSON output
itself comes from a dataclass's to_dict / to_json / as_dict."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "pipeinfer_cli"
JSON_METHODS = {"to_dict", "to_json", "as_dict"}


def _bare_dict(annotation) -> bool:
    """Whether `dict` appears in the annotation without its key and value types."""
    if annotation is None:
        return False
    typed = {id(n.value) for n in ast.walk(annotation) if isinstance(n, ast.Subscript)}
    return any(isinstance(n, ast.Name) and n.id == "dict" and id(n) not in typed for n in ast.walk(annotation))


def _returns_dict_literal(fn) -> bool:
    return any(isinstance(n, ast.Return) and isinstance(n.value, (ast.Dict, ast.DictComp)) for n in ast.walk(fn))


def _bare_dict_functions(tree: ast.AST) -> list[str]:
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in JSON_METHODS:
            continue
        if _bare_dict(fn.returns) or (fn.returns is None and _returns_dict_literal(fn)):
            found.append(f"{fn.name} (line {fn.lineno})")
    return found


def test_the_check_sees_bare_dicts():
    code = ("def a() -> dict: ...\ndef b() -> dict | None: ...\ndef c() -> list[dict]: ...\n"
            "def d() -> dict[str, int]: ...\ndef e():\n    return {1: 2}\ndef to_json(self) -> dict: ...\n")
    assert [f.split()[0] for f in _bare_dict_functions(ast.parse(code))] == ["a", "b", "c", "e"]


def test_no_function_returns_a_bare_dict():
    found = []
    for folder in ("decode", "runtime", "planner"):
        for path in sorted((SRC / folder).rglob("*.py")):
            found += [f"{path.relative_to(SRC)}: {f}" for f in _bare_dict_functions(ast.parse(path.read_text()))]
    assert not found, "functions returning a bare dict (return a dataclass, or type the mapping): " + ", ".join(found)

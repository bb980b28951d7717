"""No function of the policies (decode/), the runtime or the planner returns a bare `dict`: a value's
shape is in its type (a dataclass, or a mapping typed key -> value). A dict that is the JSON output
itself comes from a dataclass's to_dict / to_json / as_dict.

In the whole package, a function returns an untyped dict (`dict`, or `dict[K, Any]` / `dict[K,
object]`) only where a JSON document or an HTTP body is what it builds: the to_dict / to_json /
as_dict methods, the OpenAI-compatible bodies (server/openai_*.py) and bench's records and
documents (bench/, what `bench --json` writes); elsewhere at most UNTYPED_ELSEWHERE functions, a
count that only goes down. A record with fixed keys is a dataclass, a NamedTuple, or a TypedDict
where the JSON shape is the point (native.HParams, mpi_link.WireTraffic, parallel.SlotRow)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "pipeinfer_cli"
JSON_METHODS = {"to_dict", "to_json", "as_dict"}
JSON_BUILDERS = ("bench/", "server/openai_")  # paths (relative to the package) whose functions build JSON or HTTP bodies
UNTYPED_ELSEWHERE = 10  # runtime/engine._slot_rows and server/front_requests.slot_rows may return list[runtime.parallel.SlotRow]: then 8


def _bare_dict(annotation) -> bool:
    """Whether `dict` appears in the annotation without its key and value types."""
    if annotation is None:
        return False
    typed = {id(n.value) for n in ast.walk(annotation) if isinstance(n, ast.Subscript)}
    return any(isinstance(n, ast.Name) and n.id == "dict" and id(n) not in typed for n in ast.walk(annotation))


def _untyped_dict(annotation) -> bool:
    """A bare `dict`, or a dict whose values are `Any` or `object` (a record without its shape)."""
    if annotation is None:
        return False
    loose = any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "dict"
                and isinstance(n.slice, ast.Tuple) and len(n.slice.elts) == 2
                and isinstance(n.slice.elts[1], ast.Name) and n.slice.elts[1].id in ("Any", "object")
                for n in ast.walk(annotation))
    return loose or _bare_dict(annotation)


def _untyped_dict_functions(tree: ast.AST) -> list[str]:
    return [f"{fn.name} (line {fn.lineno})" for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name not in JSON_METHODS
            and _untyped_dict(fn.returns)]


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


def test_the_count_sees_untyped_dicts():
    code = ("def a() -> dict: ...\ndef b() -> dict[str, Any]: ...\ndef c() -> list[dict[str, object]]: ...\n"
            "def d() -> dict[str, int]: ...\ndef e() -> HParams: ...\ndef as_dict(self) -> dict: ...\n")
    assert [f.split()[0] for f in _untyped_dict_functions(ast.parse(code))] == ["a", "b", "c"]


def test_few_functions_return_an_untyped_dict_outside_json_builders():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel.startswith(JSON_BUILDERS):
            continue
        found += [f"{rel}: {f}" for f in _untyped_dict_functions(ast.parse(path.read_text()))]
    assert len(found) <= UNTYPED_ELSEWHERE, (f"{len(found)} functions return an untyped dict (at most "
                                             f"{UNTYPED_ELSEWHERE}; give the new one its type): " + ", ".join(found))

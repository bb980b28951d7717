"""`--draft` as one typed value (decode/draft_spec.py): every form parses, bad ones fail with one
clear message, and no other module compares draft kinds as strings."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from pipeinfer_cli.decode.draft_spec import DraftSpec, DraftSpecError

SRC = Path(__file__).resolve().parent.parent / "src" / "pipeinfer_cli"
SPEC_MODULE = SRC / "decode" / "draft_spec.py"


@pytest.mark.parametrize("text, kind, model, label, props", [
    (None, "none", None, None, set()),
    ("lookup", "lookup", None, "lookup", {"is_lookup", "uses_lookup"}),
    (" lookup ", "lookup", None, "lookup", {"is_lookup", "uses_lookup"}),
    ("smollm2-135m-instruct", "model", "smollm2-135m-instruct", "smollm2-135m-instruct", {"uses_model"}),
    ("/models/draft.gguf", "model", "/models/draft.gguf", "/models/draft.gguf", {"uses_model"}),
    ("lookup+smollm2-135m-instruct", "hybrid", "smollm2-135m-instruct", "lookup+smollm2-135m-instruct",
     {"is_hybrid", "uses_model", "uses_lookup"}),
    ("lookup+ /m/d.gguf", "hybrid", "/m/d.gguf", "lookup+/m/d.gguf", {"is_hybrid", "uses_model", "uses_lookup"}),
])
def test_every_form_parses(text, kind, model, label, props):
    spec = DraftSpec.parse(text)
    assert (spec.kind, spec.model, spec.label) == (kind, model, label)
    flags = {"is_none", "is_lookup", "is_hybrid", "uses_model", "uses_lookup"}
    assert {f for f in flags if getattr(spec, f)} == props | ({"is_none"} if kind == "none" else set())
    assert bool(spec) == (kind != "none")
    assert pickle.loads(pickle.dumps(spec)) == spec  # travels to other ranks with the job config
    assert DraftSpec.parse(spec.label) == spec  # a label reads back as the same spec


@pytest.mark.parametrize("text, kind, model, front, label, props", [
    ("suffix", "suffix", None, None, "suffix", {"is_suffix", "is_free", "uses_suffix"}),
    ("lookup", "lookup", None, None, "lookup", {"is_lookup", "is_free", "uses_lookup"}),
    ("suffix+smollm2-135m-instruct", "hybrid", "smollm2-135m-instruct", "suffix", "suffix+smollm2-135m-instruct",
     {"is_hybrid", "uses_model", "uses_suffix"}),
    ("lookup+m", "hybrid", "m", "lookup", "lookup+m", {"is_hybrid", "uses_model", "uses_lookup"}),
])
def test_suffix_forms_parse(text, kind, model, front, label, props):
    spec = DraftSpec.parse(text)
    assert (spec.kind, spec.model, spec.front, spec.label) == (kind, model, front, label)
    flags = {"is_lookup", "is_suffix", "is_free", "is_hybrid", "uses_model", "uses_lookup", "uses_suffix"}
    assert {f for f in flags if getattr(spec, f)} == props
    assert pickle.loads(pickle.dumps(spec)) == spec and DraftSpec.parse(spec.label) == spec
    assert spec.resolved("/c/m.gguf").front == front
    # The planner predicts suffix drafting as prompt lookup.
    assert not spec.planned().uses_suffix and spec.planned().uses_model == spec.uses_model


def test_frozen_and_resolved():
    spec = DraftSpec.parse("lookup+small")
    with pytest.raises(AttributeError):
        spec.kind = "lookup"
    resolved = spec.resolved("/cache/small.gguf")
    assert resolved.label == "lookup+/cache/small.gguf" and spec.model == "small"
    assert DraftSpec.lookup().resolved("x") == DraftSpec.lookup()


@pytest.mark.parametrize("text, says", [
    ("", "--draft is empty"), ("   ", "--draft is empty"),
    ("lookup+", "after 'lookup+' name a draft model"), ("lookup+ ", "after 'lookup+' name a draft model"),
    ("lookup+lookup", "after 'lookup+' name a draft model"),
    ("lookup+lookup+m", "after 'lookup+' name a draft model"),
    ("suffix+", "after 'suffix+' name a draft model"), ("suffix+suffix", "after 'suffix+' name a draft model"),
    ("suffix+lookup", "after 'suffix+' name a draft model"), ("lookup+suffix", "after 'lookup+' name a draft model"),
    ("suffix+lookup+m", "after 'suffix+' name a draft model"),
])
def test_bad_input_is_one_clear_error(text, says):
    with pytest.raises(DraftSpecError) as e:
        DraftSpec.parse(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_inconsistent_spec_is_refused():
    with pytest.raises(DraftSpecError):
        DraftSpec("model")
    with pytest.raises(DraftSpecError):
        DraftSpec("lookup", "m")
    with pytest.raises(DraftSpecError):
        DraftSpec("translated", "m")
    with pytest.raises(DraftSpecError):
        DraftSpec("suffix", front="lookup")
    with pytest.raises(DraftSpecError):
        DraftSpec("hybrid", "m", front="model")


def _is_kind_text(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value in ("lookup", "suffix") or node.value.startswith(("lookup+", "suffix+")))


def _holds_kind_text(node) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_kind_text(e) for e in node.elts)
    return _is_kind_text(node)


def _string_kind_checks(tree: ast.AST) -> list[int]:
    """Lines comparing a value with "lookup" / "lookup+…" (==, !=, in), testing a "lookup+" prefix,
    or building a "lookup+" label. A dict key, an attribute set to "lookup" or a call's argument is
    not a comparison."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            if any(_holds_kind_text(n) for n in [node.left, *node.comparators]):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "removeprefix", "partition", "split") and \
                any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith(("lookup", "suffix"))
                    for a in node.args):
            lines.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and \
                any(isinstance(n, ast.Constant) and n.value in ("lookup+", "suffix+") for n in (node.left, node.right)):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_string_comparisons():
    code = ('a == "lookup"\nb in (None, "lookup")\nc.startswith("lookup+")\n"lookup+" + d\n'
            'e = {"lookup": 1}\nname = "lookup"\nf("lookup")\ng != "lookup+x"\n')
    assert sorted(_string_kind_checks(ast.parse(code))) == [1, 2, 3, 4, 8]


def test_no_string_comparison_of_draft_kinds_outside_the_spec():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SPEC_MODULE:
            continue
        for line in _string_kind_checks(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(SRC)}:{line}")
    assert not found, ("draft kinds compared as strings (ask the DraftSpec: is_lookup, uses_model, is_hybrid): "
                       + ", ".join(found))

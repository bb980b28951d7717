"""The code's seams: decoding policies import no MPI, the engine's modules import one way, and the
mode registry is the one place that knows what a mode needs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pipeinfer_cli.runtime.loading import spec_margin
from pipeinfer_cli.decode.modes import (
    MODE_NAMES, DraftNeededError, UnknownModeError, check_mode, default_mode, get_mode, needs_draft,
)
from pipeinfer_cli.decode.session import DecodeOptions

SRC = Path(__file__).resolve().parents[1] / "src" / "pipeinfer_cli"
POLICIES = sorted(f"{pkg}.{p.stem}" for pkg in ("decode", "planner") for p in (SRC / pkg).glob("*.py")
                  if p.stem != "__init__")


@pytest.mark.parametrize("module", POLICIES)
def test_policy_modules_import_no_mpi(module):
    """A simulator runs the same policies in virtual time: importing them must not start MPI."""
    code = (f"import sys, pipeinfer_cli.{module}; "
            "bad = [m for m in ('mpi4py', 'mpi4py.MPI') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# Layers, top to bottom: a module may import its own layer's modules and any layer below it.
LAYERS = [
    {"cli"},  # the commands
    {"server", "bench"},  # the front ends' engines: HTTP, benchmarks
    {"runtime"},  # the processes of a job
    {"planner"},  # predictions from a profile: runs the policies in virtual time
    {"decode", "transport"},  # pure policies; the wire and its waits
    {"models"},  # model files: registry, fetching and cache, GGUF headers, identities, layer splits, slices
    {"native", "_native", "errors", "wording", "process_memory"},  # the C++ engine's wrapper; what every layer shares
]


def _layer(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def _module_imports() -> dict[str, set[str]]:
    """'decode.session' -> the package modules it imports (at any level of the file)."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("").parts
        if "__pycache__" in rel or rel[-1] in ("__init__", "__main__"):
            continue
        name = ".".join(rel)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = list(rel[:-1])[: len(rel) - node.level]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                if target:
                    deps.add(target)
        out[name] = deps
    return out


def test_imports_go_one_way():
    """No import points up the layers (cli -> runtime -> decode/transport -> native)."""
    bad = []
    for name, deps in _module_imports().items():
        for dep in deps:
            top, dep_top = name.split(".")[0], dep.split(".")[0]
            if _layer(dep_top) < _layer(top):
                bad.append(f"{name} imports {dep}")
    assert not bad, bad


def test_the_wire_imports_no_policy():
    """decode/ and transport/ share a layer: a policy may read the wire's messages, the wire never
    imports a policy (what both need lives below them)."""
    bad = [f"{name} imports {dep}" for name, deps in _module_imports().items() if name.startswith("transport.")
           for dep in deps if dep.split(".")[0] == "decode"]
    assert not bad, bad


def test_no_import_cycles():
    imports = _module_imports()  # parsed once: every module's imports, read from its source
    graph = {k: {d for d in v if d in imports} for k, v in imports.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if state.get(dep) is None:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in graph:
        if state.get(name) is None:
            visit(name, [name])


def test_the_mode_registry():
    assert MODE_NAMES == ("iterative", "speculative", "pipeinfer")
    assert [needs_draft(m) for m in MODE_NAMES] == [False, True, True]
    assert default_mode(has_draft=True) == "pipeinfer" and default_mode(has_draft=False) == "iterative"
    assert check_mode(None, has_draft=False) == "iterative"
    with pytest.raises(DraftNeededError, match="--mode speculative needs a draft"):
        check_mode("speculative", has_draft=False)
    with pytest.raises(UnknownModeError, match="unknown --mode 'fast'; choose one of iterative, speculative"):
        get_mode("fast")
    opts = DecodeOptions(n_draft=4, max_inflight=3)
    assert [get_mode(m).kv_margin(opts) for m in MODE_NAMES] == [1, 4 + 2, 4 * 3 + 2]
    assert spec_margin("pipeinfer", opts) == 14


def test_modules_and_functions_stay_small():
    """One concern per file: no module over 400 lines, no function over 60."""
    big_modules, big_functions = [], []
    for path in SRC.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        text = path.read_text()
        if text.count("\n") > 400:
            big_modules.append(f"{path.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                big_functions.append(f"{path.relative_to(SRC)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big_modules and not big_functions, (big_modules, big_functions)


def test_the_package_never_imports_what_sits_beside_it():
    """benchmarks/, cluster/ and scripts/ use the package; the package never imports them."""
    bad = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(SRC)} imports {n}" for n in names
                    if n.split(".")[0] in ("benchmarks", "cluster", "scripts", "benchlib", "emulate_cluster")]
    assert not bad, bad

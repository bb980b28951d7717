"""The code's seams: decoding policies import no MPI, the engine's modules import one way, and the
mode registry is the one place that knows what a mode needs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pipeinfer_cli.engine.loading import spec_margin
from pipeinfer_cli.engine.modes import (
    MODE_NAMES, DraftNeededError, UnknownModeError, check_mode, default_mode, get_mode, needs_draft,
)
from pipeinfer_cli.engine.session import DecodeOptions

SRC = Path(__file__).resolve().parents[1] / "src" / "pipeinfer_cli"
POLICIES = ["modes", "decode_sync", "decode_pipeinfer", "draft_economy", "drafters", "lookup", "tree", "kv_slots",
            "session", "sampling", "async_draft", "pipeline_protocol"]


@pytest.mark.parametrize("module", POLICIES)
def test_policy_modules_import_no_mpi(module):
    """A simulator runs the same policies in virtual time: importing them must not start MPI."""
    code = (f"import sys, pipeinfer_cli.engine.{module}; "
            "bad = [m for m in ('mpi4py', 'mpi4py.MPI') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _engine_imports() -> dict[str, set[str]]:
    """engine module -> the engine modules it imports (at any level of the file)."""
    out = {}
    for path in (SRC / "engine").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module.split(".")[0])
        out[path.stem] = deps
    return out


def test_engine_has_no_import_cycles():
    graph = _engine_imports()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]) if dep in stack
                            else f"import cycle through {dep}")
            if dep in graph and state.get(dep) is None:
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

    class Req:
        mode = "pipeinfer"

    class Cfg:
        decode = opts

    assert spec_margin(Cfg, Req) == 14

"""The one runner every benchmark launches its jobs through: a `pipeinfer` command as a user types it
(through the CLI, paths shown relative to the checkout so that BENCHMARKS.md can quote it), its
--json document read back, its exit status, wall time and `Error:` line kept.

    from benchmarks.runner import pipeinfer, run_json
    job = run_json(pipeinfer("bench", model, "--ranks", 2, "--json", out), out)

The job runs in a process group of its own: a timeout or Ctrl-C ends the whole group (the
launcher's mpiexec and every rank), so no benchmark leaves a rank behind. A job of several ranks is
started by the package's launcher (`--ranks N` relaunches it under mpiexec); a benchmark that
drives the runtime directly uses `relaunch_self`, so no benchmark builds an mpiexec command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The installed command, which a user types: beside this Python (`.venv/bin/python -m benchmarks...`),
# else the checkout's venv; PIPEINFER= points the benchmarks at another install.
_BESIDE = Path(sys.executable).with_name("pipeinfer")
PIPEINFER = os.environ.get("PIPEINFER", str(_BESIDE if _BESIDE.exists() else ROOT / ".venv" / "bin" / "pipeinfer"))


def log(msg: str) -> None:
    """Progress goes to stderr; stdout is the table."""
    print(msg, file=sys.stderr, flush=True)


def shown(cmd: Iterable[str]) -> str:
    """A command as printed and recorded: paths inside the checkout made relative to it."""
    return shlex.join(str(x).removeprefix(str(ROOT) + os.sep) for x in cmd)


def pipeinfer(*args, program: str | None = None) -> list[str]:
    """The command line `pipeinfer ARGS...` (each argument made a string)."""
    return [program or PIPEINFER, *(str(a) for a in args)]


def module(name: str, *args) -> list[str]:
    """The command line of another benchmark of this package: `python -m benchmarks.NAME ARGS...`."""
    return [sys.executable, "-m", f"benchmarks.{name}", *(str(a) for a in args)]


def target_model(spec: str) -> tuple[str, Path]:
    """(label, path) of the model a benchmark measures: a pair name's target, a registry name
    (pulled on first use, as `pipeinfer` pulls it), or a GGUF path."""
    from pipeinfer_cli.models.fetch import pull_model
    from pipeinfer_cli.models.registry import load_registry

    reg = load_registry()
    if spec in reg.pairs:
        spec = reg.pairs[spec].target
    if spec in reg.models:
        return spec, pull_model(reg.models[spec])
    return spec, Path(spec).expanduser()


@dataclass
class JobRun:
    """One job: its exit status, wall time, and either its JSON document or the reason it has none."""

    returncode: int
    wall_s: float
    doc: dict | None
    error: str | None
    output: str  # what it printed on stdout
    stderr: str = ""

    @property
    def ok(self) -> bool:
        """It exited 0 and wrote its document."""
        return self.returncode == 0 and self.doc is not None

    def facts(self) -> dict:
        """What a benchmark records of every run, besides the document."""
        return {"returncode": self.returncode, "wall_s": round(self.wall_s, 2), "loadavg_end": list(os.getloadavg())}

    def kept(self) -> dict:
        """What a benchmark keeps of a run: its facts, and its document (`doc`) or its `error`."""
        return {**self.facts(), **({"doc": self.doc} if self.doc is not None else {"error": self.error})}


def error_of(text: str, tail: int = 5) -> str:
    """What a failed command said: its `Error: ...` line, else its last lines."""
    lines = text.strip().splitlines()
    said = [x for x in lines if x.startswith("Error")]
    return said[0] if said else "\n".join(lines[-tail:])


def end_group(proc: subprocess.Popen, first: int = signal.SIGINT, grace: float = 10.0) -> None:
    """`first` to the job's process group (SIGINT: the CLI's own clean stop), SIGKILL to whatever
    of it is left after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, first)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_json(cmd: list[str], out: Path | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, quiet: bool = False) -> JobRun:
    """Run cmd and read its JSON: from the file `out` it writes (`--json OUT`), or with out=None
    from its stdout (`generate --json`, `plan --json`). env is added to this process's environment
    (a cluster's, a knob under test). A failure is logged in one line unless quiet."""
    if out is not None:
        Path(out).unlink(missing_ok=True)
    full_env = {**os.environ, **(env or {})}
    # Benchmarks started as `python -m benchmarks.X` find the checkout wherever the job runs.
    full_env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), full_env.get("PYTHONPATH", "")) if x)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as e:  # not installed there (PIPEINFER=, --pipeinfer)
        log(f"  cannot run {shown(cmd[:1])}: {e.strerror}")
        return JobRun(127, 0.0, None, f"cannot run {shown(cmd[:1])}: {e.strerror}", "")
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_group(proc)
        return JobRun(124, time.monotonic() - t0, None, f"did not finish in {timeout:.0f} s", "")
    except BaseException:  # Ctrl-C, SIGTERM: the job goes with the benchmark
        end_group(proc)
        raise
    wall = time.monotonic() - t0
    doc, error = None, None
    try:
        if out is None:
            doc = json.loads(stdout) if proc.returncode == 0 else None
        elif Path(out).exists():
            doc = json.loads(Path(out).read_text())
    except ValueError as e:
        error = f"its JSON does not parse: {e}"
    if doc is None and error is None:
        error = error_of(stderr or stdout) or f"exit status {proc.returncode}"
    if proc.returncode != 0 and error is None:
        error = error_of(stderr or stdout) or f"exit status {proc.returncode}"
    if error and not quiet:
        log(f"  failed (exit {proc.returncode}): {error}")
    return JobRun(proc.returncode, wall, doc, error, stdout, stderr)


def relaunch_self(n_ranks: int, argv: list[str], entry: str, env: dict[str, str] | None = None) -> int:
    """Run the benchmark module `entry` (benchmarks.X) as an MPI job of n_ranks processes, through
    the package's launcher: its signal handling, its one error line, nothing left behind."""
    from pipeinfer_cli.transport.launch import relaunch

    os.environ.update(env or {})
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return relaunch(n_ranks, argv, program=[sys.executable, "-m", entry])

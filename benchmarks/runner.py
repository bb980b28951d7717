"""The benchmark scripts' shared harness: run a `pipeinfer` job and keep its JSON, run it on an
emulated cluster, the figures (medians per prompt, ratios paired by prompt), the Markdown table and
the --json document.

Every `bench_*` script times jobs the same way: it runs a command line a user could type (shown
with paths relative to the checkout, so that BENCHMARKS.md can quote it), lets `pipeinfer bench`
(or scripts/bench_llamacpp.py) write its JSON into a file, and pools the records of several rounds.
The jobs themselves are started by the package's launcher (`pipeinfer ... --ranks N` relaunches
itself under mpiexec; a script that drives the runtime directly uses `relaunch_self`), so no
benchmark builds an mpiexec command line of its own.

    import benchlib
    run = benchlib.run_json([benchlib.PIPEINFER, "bench", ...], out_path)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The installed command, which a user types: beside this Python (`.venv/bin/python scripts/...`), else
# the checkout's venv; PIPEINFER= points the scripts at another install.
_BESIDE = Path(sys.executable).with_name("pipeinfer")
PIPEINFER = os.environ.get("PIPEINFER", str(_BESIDE if _BESIDE.exists() else ROOT / ".venv" / "bin" / "pipeinfer"))


def log(msg: str) -> None:
    """Progress goes to stderr; stdout is the table."""
    print(msg, file=sys.stderr, flush=True)


def shown(cmd: Iterable[str]) -> str:
    """A command as printed and recorded: paths inside the checkout made relative to it."""
    return shlex.join(x.removeprefix(str(ROOT) + os.sep) for x in cmd)


def target_model(spec: str) -> tuple[str, Path]:
    """(label, path) of the model a script measures: a pair name's target, a registry name (pulled
    on first use, as `pipeinfer` pulls it), or a GGUF path."""
    from pipeinfer_cli.models.fetch import pull_model
    from pipeinfer_cli.models.registry import load_registry

    reg = load_registry()
    if spec in reg.pairs:
        spec = reg.pairs[spec].target
    if spec in reg.models:
        return spec, pull_model(reg.models[spec])
    return spec, Path(spec).expanduser()


# -- running a job ------------------------------------------------------------------------------

@dataclass
class JobRun:
    """One command that writes a JSON document to a file: its exit status, wall time and either
    the document or the reason it wrote none."""

    returncode: int
    wall_s: float
    doc: dict | None
    error: str | None
    output: str  # what it printed on stdout

    def facts(self) -> dict:
        """What a script records of every run, besides the document."""
        return {"returncode": self.returncode, "wall_s": round(self.wall_s, 2), "loadavg_end": list(os.getloadavg())}


def error_of(text: str, tail: int = 5) -> str:
    """What a failed command said: its `Error: ...` line, else its last lines."""
    lines = text.strip().splitlines()
    said = [x for x in lines if x.startswith("Error")]
    return said[0] if said else "\n".join(lines[-tail:])


def run_json(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> JobRun:
    """Run cmd, which writes its JSON to `out` (`--json OUT`), and read it back. env is added to this
    process's environment (a cluster's, a knob under test)."""
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False)
    except OSError as e:  # not installed there (PIPEINFER=, --pipeinfer)
        log(f"  cannot run {shown(cmd[:1])}: {e.strerror}")
        return JobRun(127, 0.0, None, f"cannot run {shown(cmd[:1])}: {e.strerror}", "")
    wall = time.monotonic() - t0
    if out.exists():
        return JobRun(proc.returncode, wall, json.loads(out.read_text()), None, proc.stdout)
    error = error_of(proc.stderr or proc.stdout)
    log(f"  failed (exit {proc.returncode}): {error}")
    return JobRun(proc.returncode, wall, None, error, proc.stdout)


def run_stdout_json(cmd: list[str]) -> tuple[dict | None, str | None]:
    """(the JSON a command printed on stdout, None) or (None, its error): `pipeinfer plan --json`."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return None, error_of(proc.stderr, tail=1) or f"exit status {proc.returncode}"
    return json.loads(proc.stdout), None


def relaunch_self(n_ranks: int, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run this script as an MPI job of n_ranks processes (each rank runs `python SCRIPT ARGV`),
    through the package's launcher: its signal handling, its one error line, nothing left behind."""
    from pipeinfer_cli.transport.launch import relaunch

    os.environ.update(env or {})
    return relaunch(n_ranks, argv, program=[sys.executable, os.path.abspath(sys.argv[0])])


# -- the emulated cluster -----------------------------------------------------------------------

def stop_signals_interrupt() -> None:
    """SIGTERM and SIGHUP end the campaign as Ctrl-C does, so that its cluster is taken down."""
    def interrupted(_signum, _frame):
        raise KeyboardInterrupt

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupted)


@contextlib.contextmanager
def emulated_cluster(prefix: str, subnet: str, n_hosts: int, rate: str, cpus: str | None = None,
                     mem: str | None = None) -> Iterator:
    """A fresh emulated cluster (scripts/emulate_cluster.py) of n_hosts, up for the block and taken
    down after it, even on Ctrl-C. One that exists already is someone else's: never touched."""
    from emulate_cluster import Cluster, Failure

    c = Cluster(prefix, subnet)
    if c.is_up or c._leftovers():
        raise Failure(f"an emulated cluster {prefix} exists already; `scripts/emulate-cluster.sh --prefix {prefix} "
                      f"--subnet {subnet} down` it or choose another --prefix and --subnet")
    log(f"scripts/emulate-cluster.sh --prefix {prefix} --subnet {subnet} up {n_hosts} --rate {rate}"
        + (f" --cpus {cpus}" if cpus else "") + (f" --mem {mem}" if mem else ""))
    try:
        c.up(n_hosts, rate, cpus, mem)
        yield c
    finally:
        # A second Ctrl-C must not leave half a cluster behind.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        log(f"scripts/emulate-cluster.sh --prefix {prefix} --subnet {subnet} down")
        try:
            c.down()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def main_guard(main) -> int:
    """A campaign's exit status: `Error: interrupted` (130) on Ctrl-C or SIGTERM, one `Error:` line
    (1) for a cluster that cannot be set up."""
    from emulate_cluster import Failure

    stop_signals_interrupt()
    try:
        return main()
    except KeyboardInterrupt:
        log("Error: interrupted")
        return 130
    except Failure as e:
        log(f"Error: {e}")
        return 1


# -- figures ------------------------------------------------------------------------------------

def median(values: Iterable[float | None]) -> float | None:
    """The median of the values given (None ones left out), or None."""
    xs = [v for v in values if v]
    return statistics.median(xs) if xs else None


def per_prompt(records: Iterable[dict], key: str = "tok_per_s") -> dict[str, float]:
    """{prompt: median of key over the records of that prompt}."""
    groups: dict[str, list[float]] = {}
    for r in records:
        if r.get(key):
            groups.setdefault(r["prompt_id"], []).append(r[key])
    return {p: statistics.median(v) for p, v in groups.items()}


def paired_ratio(a: dict[str, float], b: dict[str, float]) -> float | None:
    """a over b paired by prompt: the geometric mean over the prompts of both of a/b."""
    rs = [a[p] / b[p] for p in a if p in b and a[p] > 0 and b[p] > 0]
    return math.exp(statistics.fmean(math.log(x) for x in rs)) if rs else None


def measured(doc: dict | None) -> list[dict]:
    """The records of a `pipeinfer bench` document without its warm-up rounds."""
    return [r for r in (doc or {}).get("records", []) if not r.get("warmup")]


# -- output -------------------------------------------------------------------------------------

def fmt(v, spec: str = ".2f", suffix: str = "", none: str = "–") -> str:
    return none if v is None else f"{v:{spec}}{suffix}"


def markdown_table(head: list[str], rows: list[list[str]], align: str = "") -> str:
    """A Markdown table. align: one letter per column, l (names) or r (figures); the default is
    the first column left and the others right."""
    align = align or "l" + "r" * (len(head) - 1)
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
                      *("| " + " | ".join(r) + " |" for r in rows)])


def write_json(path: Path | None, doc: dict, indent: int | None = 1) -> None:
    """The --json document, its directory made; announced on stderr."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    log(f"wrote {shown([str(path)])}")

"""`pipeinfer calibrate MODEL`: measure every rank of a job and write the profile a planner predicts from."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ..errors import UsageError
from ..transport.deadlines import CALIBRATE_RANK_TIMEOUT_S
from .calibrate_run import probe_spec, progress, save_profile
from .console import err, out
from .job_options import JobOptions
from .job_setup import begin_job, run_here_or_relaunch
from .options import (CtxOption, DraftOption, JobRanksOption, LayerSplitOption, ModelArg, NDraftOption,
                      NoPullOption, RankTimeoutOption, ThreadsOption)
from .wording import epilog, human_bytes, plural

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig
    from ..planner.profile import Profile

# The epoch time the command started at, passed to the relaunched job (its head prints the duration).
STARTED_ENV = "PIPEINFER_CALIBRATE_STARTED"
NON_TTY_WIDTH = 200  # into a file or a pipe (under mpiexec, always), the table is never cut

EPILOG = epilog("""Examples:

  pipeinfer calibrate qwen-coder --ranks 2 --quick

  pipeinfer calibrate smollm2-135m-instruct --draft lookup --out smollm2.json

  mpiexec -f hosts -n 4 pipeinfer calibrate qwen-coder --out cluster.json

What is measured, on ranks of different hosts at the same time and on ranks that share a host in
turn (the others sleep, so that they do not disturb each other): seconds per layer of a
batch-invariant run of 1 to 2 x --n-draft rows (decoding and verifying drafted tokens) at KV
lengths 16, 256 and 1024, and of prompt chunks of 16, 64 and 256 tokens, on a probe of the layers
just before the last one (about 512 MB of weights, 128 MB with --quick); the cost of an output row
(LM head and sampler) on the last layer; the rank's fixed cost per run (the head's
loop); with --draft, the draft's seconds per proposed token and per prompt token, on the rank that
would run it, and a draft model's acceptance (its greedy next token against the whole target's on
96 tokens of the answer to a calibration chat request, the raw text where the target has no chat
template, 32 with --quick, on the head, where both fit in its memory: what
-M auto plans with); then latency and bandwidth of every link the job uses (each stage to the next, the
last back to the head, a draft rank), with the job's real waits; and each host's CPU, cores and
memory.

For the Qwen pair on 2 ranks of a 2-core machine it took about 2 minutes; --quick (fewer
repetitions, two KV lengths, batches up to --n-draft + 1 rows, a quarter of the layers) about 40
seconds. Slower hosts take longer, and ranks without the model wait for their weights first
(docs/calibrate.md, "How long"). Run it on a quiet machine, with the ranks, threads and launcher of
the jobs it should predict (the job options are generate's). Ranks it starts on this machine with
--threads equal to its CPUs are timed as an iterative `generate --ranks N` runs them at its default
threads (every CPU each, a brief spin between graphs); ranks that share the machine otherwise wait
passively, as those of the speculative modes do. The profile records how each rank waited
(omp_wait), and plan compares it.

Only the head needs the model files, as for generate: a rank without them is sent the layers it
times (one slice: the probe's layers and the last one; the whole draft file to the rank that times
a draft), less what its node cache holds; the head says what it sends, with progress.

Every figure is timed again, round after round, until the median of its repeats is within 10 % of
the best one (at most 21 timed rounds, 6 with --quick); the worst spread of each rank is in the
profile and the table. A figure that never settles, and ranks of the same hardware (CPU model,
usable CPUs, threads) whose one-row figures differ by more than 25 %, are named in a warning.

The profile (--out, default profile.json; --json prints it too) is what `pipeinfer plan --profile
FILE` predicts each mode's speed from, without running it, and what `--layer-split auto --profile
FILE` splits the layers by. docs/calibrate.md describes its fields.
""")

OutOption = Annotated[Path, typer.Option("--out", "-o", help="Write the profile here (JSON; replaced atomically).")]
ProfileJsonFlag = Annotated[bool, typer.Option("--json", help="Print the profile (what --out holds) on stdout instead of the table.")]
QuickOption = Annotated[bool, typer.Option("--quick", help="Fewer repetitions (3 rounds, at most 6 while they disagree) on a quarter of the layers (128 MB of weights: also what a rank without the model is sent): under a minute for the Qwen pair on 2 ranks of one machine, noisier figures.")]


def calibrate(
    model: ModelArg,
    draft: DraftOption = None,
    ranks: JobRanksOption = None,
    layer_split: LayerSplitOption = None,
    threads: ThreadsOption = None,
    ctx: CtxOption = 4096,
    n_draft: NDraftOption = 4,
    out_path: OutOption = Path("profile.json"),
    quick: QuickOption = False,
    as_json: ProfileJsonFlag = False,
    rank_timeout: RankTimeoutOption = CALIBRATE_RANK_TIMEOUT_S,
    no_pull: NoPullOption = False,
) -> None:
    """Measure what every rank of a job costs (layers, output, runs, draft, links) and write a profile.

    Progress goes to stderr, a table to stdout (--json: the profile instead), the profile to --out.
    """
    from ..transport.launch import under_mpi_launcher

    started = float(os.environ.get(STARTED_ENV) or time.time())
    if _on_head(under_mpi_launcher()):  # the head writes the profile
        check_out_path(out_path)
    if layer_split and layer_split.startswith("auto"):  # measured with equal shares: no profile needed first
        from ..runtime.calibrate import calibration_split
        from ..transport.start_waits import launcher_size

        layer_split = calibration_split(layer_split, ranks or launcher_size() or 1)
    job = JobOptions(draft=draft, ranks=ranks, layer_split=layer_split, threads=threads, ctx=ctx, n_draft=n_draft,
                     rank_timeout=rank_timeout, no_pull=no_pull)
    start = begin_job(model, None, None, job, drafts=True)  # its plan checks the split of the ranks it starts
    prep = start.prep
    if _on_head(start.inside):  # the other ranks may lack the models: the head sends them what they time
        _check_on_this_node(prep.cfg)
        _check_layers(prep.cfg)

    def relaunch_job() -> int:
        from ..transport.launch import relaunch

        os.environ[STARTED_ENV] = repr(started)
        if waits_as_iterative(threads, prep.ranks):
            from ..runtime.topology import WHOLE_HOST_ENV
            from .generate_cmd import ITERATIVE_SPIN_COUNT

            os.environ[WHOLE_HOST_ENV] = "1"  # the ranks wait as an iterative job's (cli/app.omp_wait_policy)
            os.environ.setdefault("GOMP_SPINCOUNT", ITERATIVE_SPIN_COUNT)
        return relaunch(prep.ranks, sys.argv[1:])

    run_here_or_relaunch(prep, start.inside, relaunch_job)
    from ..runtime.calibrate import run_calibration

    profile = run_calibration(prep.cfg, probe_spec(prep.cfg, quick, prep.ranks), "pipeinfer " + shlex.join(sys.argv[1:]),
                              progress)
    if profile is not None:  # the head reports; the other ranks are done
        _finish(profile, prep.cfg, quick, out_path, as_json, started)


def _finish(profile: Profile, cfg: JobConfig, quick: bool, out_path: Path, as_json: bool, started: float) -> None:
    """On the head: the calibration's warnings, the draft's acceptance, the profile written and shown."""
    save_profile(profile, cfg, quick, out_path)
    if as_json:
        sys.stdout.write(profile.to_json() + "\n")
    else:
        print_tables(profile, cfg.decode.n_draft)
    err.print(f"pipeinfer calibrate: {plural(len(profile.ranks), 'rank')} measured in {time.time() - started:.1f} s; "
              f"profile written to {out_path.resolve()}", markup=False, highlight=False)


def check_out_path(path: Path) -> None:
    """--out must name a file in an existing, writable directory (checked before any job starts)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name, e.g. --out {path / 'profile.json'}")
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"--out {path}: {parent} is a file, not a directory; choose another path")
    if not parent.is_dir():
        raise UsageError(f"--out {path}: the directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--out {path}: the directory {parent} is not writable; choose another path")


def waits_as_iterative(threads: str | None, n_ranks: int, environ=os.environ) -> bool:
    """Whether the ranks that `calibrate --ranks N` starts on this machine compute with every CPU it
    grants (--threads equal to them): the job such a profile plans is an iterative `generate --ranks
    N` at its default threads (in the speculative modes ranks of several threads that overlap on too
    few CPUs are refused: planner/shared_cores.unmodelled), whose ranks spin briefly between graphs
    (cli/generate_cmd.ITERATIVE_SPIN_COUNT). Measured waiting passively, as ranks sharing a host
    otherwise do, a rank of 2 threads is ~1.4x slower than in that job (BENCHMARKS.md, "Threads per
    rank"), and `plan` predicted the job below its own 1-thread prediction. An OMP_WAIT_POLICY of the
    user's wins."""
    from ..planner.layout import parse_threads
    from ..runtime.cpu_share import cpu_share

    if n_ranks < 2 or not threads or "OMP_WAIT_POLICY" in environ:
        return False
    return set(parse_threads(threads, n_ranks)) == {cpu_share().threads}


def _on_head(inside: bool) -> bool:
    from ..transport.start_waits import launcher_rank

    return not inside or launcher_rank() == 0


def _check_on_this_node(cfg: JobConfig) -> None:
    """The head needs the models: it times them and sends the other ranks what they time."""
    from ..errors import ModelFileError

    for label, path, given in ((cfg.model_label, cfg.model_path, True),
                               (cfg.draft_label, cfg.draft_path, cfg.draft.uses_model)):
        if given and path is None:
            raise ModelFileError(f"model {label!r} is not on this node, the head of the calibration, which needs "
                                 "every model (the other ranks are sent what they time from it): pull or copy it here")


def _check_layers(cfg: JobConfig) -> None:
    from ..models.gguf_info import read_model_info

    n_layer = read_model_info(cfg.model_path).n_layer
    if n_layer < 2:
        raise UsageError(f"{cfg.model_label} has {plural(n_layer, 'layer')}; calibrate needs at least 2 (it times "
                         "the first layers apart from the last one)")


def _ms(seconds: float, digits: int = 3) -> str:
    return f"{seconds * 1e3:.{digits}f}"


def _spread(spread: dict | None) -> str:
    """The worst spread of a rank's figures, in per cent ("-" in an older profile)."""
    return f"{max(spread.values()) * 100:.0f}" if spread else "-"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def print_tables(profile, n_draft: int) -> None:
    """Per rank, per host, per link and the draft's figures, on stdout."""
    from rich.console import Console

    console = out if sys.stdout.isatty() else Console(soft_wrap=False, width=NON_TTY_WIDTH)  # a pipe: never cut
    first = profile.ranks[0]
    big = max(r for r in first.decode.rows if r <= n_draft + 1)
    m = profile.model
    console.print(f"{m.name}, {m.n_layer} layers; per layer, at KV length {first.decode.kv[0]}, prompt in chunks of "
                  f"{first.prefill.rows[-1]} tokens:", markup=False, highlight=False)
    t = Table(box=None, pad_edge=False, header_style="bold underline")
    for col in ("rank", "host", "threads", "ms/layer\n1 row", f"ms/layer\n{big} rows", "prompt µs\n/token/layer",
                "output\nms/row", "overhead\nms/run", "spread\n%"):
        t.add_column(col, justify="left" if col == "host" else "right", no_wrap=True)
    for r in profile.ranks:
        d = r.decode.s[0]
        t.add_row(str(r.rank), r.host, str(r.threads), _ms(d[0]), _ms(d[r.decode.rows.index(big)]),
                  f"{r.prefill.s[0][-1] / r.prefill.rows[-1] * 1e6:.1f}", _ms(r.output_row_s), _ms(r.run_overhead_s),
                  _spread(r.spread))
    console.print(t)
    for host in dict.fromkeys(r.host for r in profile.ranks):
        r = next(x for x in profile.ranks if x.host == host)
        usable = "" if r.usable_cpus is None or r.usable_cpus >= r.cores else f" ({r.usable_cpus:g} usable)"
        console.print(f"host {host}: {r.cpu}, {plural(r.cores, 'logical CPU')}{usable}, "
                      f"{plural(r.ranks_per_host or 1, 'rank')} of the job, memory "
                      f"{human_bytes(r.mem_total_bytes)} ({human_bytes(r.mem_available_bytes)} available)",
                      markup=False, highlight=False)
    if profile.links:
        console.print("links, one way (latency + bytes / bandwidth, the receiver's wake-up included):", markup=False,
                      highlight=False)
        console.print(_links_table(profile))
    d = profile.draft
    if d is not None:
        prompt = f", {_duration(d.prompt_token_s)} per prompt token" if d.is_model else ""
        console.print(f"draft {d.name} on rank {d.rank} ({plural(d.threads, 'thread')}): {_duration(d.token_s)} per "
                      f"proposed token{prompt}", markup=False, highlight=False)


def _links_table(profile) -> Table:
    lt = Table(box=None, pad_edge=False, header_style="bold underline")
    for col in ("link", "latency µs", "MB/s", "1 row µs", "256 rows µs"):
        lt.add_column(col, justify="right", no_wrap=True)
    row = profile.model.n_embd * 4
    for lk in profile.links:
        lt.add_row(f"{lk.src} -> {lk.dst}", f"{lk.latency_s * 1e6:.0f}", f"{lk.bytes_per_s / 1e6:.0f}",
                   f"{lk.seconds(row) * 1e6:.0f}", f"{lk.seconds(256 * row) * 1e6:.0f}")
    return lt

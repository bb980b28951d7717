"""Assembles the `pipeinfer` command from one module per command group."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Annotated


def _early_interrupt(_signum, _frame) -> None:
    os.write(2, b"Error: interrupted\n")
    os._exit(130)


# A Ctrl-C while the `pipeinfer` command still imports its modules (the first few hundred ms) ends
# it with the same one line as later instead of a traceback; main() then installs _on_interrupt.
if Path(sys.argv[0]).name == "pipeinfer" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _early_interrupt)

import typer  # noqa: E402

from .. import __version__  # noqa: E402
from . import bench_cmd, calibrate_cmd, chat_cmd, generate_cmd, inspect_cmd, models_cmd, plan_cmd, serve_cmd  # noqa: E402
from .console import err  # noqa: E402
from .errors import ErrorHandlingGroup, report  # noqa: E402


def _flags_without_type() -> None:
    """Typer 0.29's help shows a flag's type as if it took a value (`--version -V <bool>`); a flag
    takes none, so show nothing there, as click and earlier Typer versions do."""
    from typer.core import TyperOption

    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "_pipeinfer_flags", False):
        return

    def display_type_rich(self, ctx):
        if self.is_flag and self.metavar is None:
            return None
        return original(self, ctx)

    display_type_rich._pipeinfer_flags = True
    TyperOption.display_type_rich = display_type_rich


_flags_without_type()

app = typer.Typer(
    name="pipeinfer",
    cls=ErrorHandlingGroup,
    help="Fast single-request LLM generation on CPU clusters with asynchronous pipelined speculation (PipeInfer).",
    epilog=(
        "Examples:\n\n"
        "  pipeinfer models pull smollm2-135m-instruct\n\n"
        "  pipeinfer inspect qwen2.5-coder-1.5b-instruct --ranks 3\n\n"
        "Set PIPEINFER_DEBUG=1 to see tracebacks, PIPEINFER_CACHE to choose where models are stored."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models_cmd.app, name="models")
app.command("generate", epilog=generate_cmd.EPILOG)(generate_cmd.generate)
app.command("chat", epilog=chat_cmd.EPILOG)(chat_cmd.chat)
app.command("inspect")(inspect_cmd.inspect)
app.command("bench", epilog=bench_cmd.EPILOG)(bench_cmd.bench)
app.command("serve", epilog=serve_cmd.EPILOG)(serve_cmd.serve)
app.command("calibrate", epilog=calibrate_cmd.EPILOG)(calibrate_cmd.calibrate)
app.command("plan", epilog=plan_cmd.EPILOG)(plan_cmd.plan)


def _version(value: bool) -> None:
    if value:
        try:
            from .. import _native

            ggml = f"{_native.ggml_version()}, {_cpu_backend_words()}"
        except ImportError:
            ggml = "not built (run `make install`)"
        typer.echo(f"pipeinfer {__version__} (ggml {ggml})")
        raise typer.Exit()


def _cpu_backend_words() -> str:
    """Which CPU backend ggml computes with here: `CPU variant zen4 (of 13 installed)`, or the one
    built into ggml."""
    from ..errors import GgmlCpuError
    from ..native import ggml_cpu

    try:
        cpu = ggml_cpu()
    except GgmlCpuError as e:
        return f"CPU backend: {e}"
    if not cpu["dynamic"]:
        return "CPU backend built in"
    chosen = "PIPEINFER_GGML_CPU" if cpu["forced"] else "the best for this CPU"
    return f"CPU variant {cpu['variant']} ({chosen}, of {len(cpu['available'])} installed)"


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Fast single-request LLM generation on CPU clusters with asynchronous pipelined speculation."""


_interrupted = False


def _on_interrupt(_signum, _frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


class _Stopped(BaseException):
    """SIGTERM in a process no MPI launcher started (a 1-rank job, a command before it
    starts its job): raised on the main thread, so that the command unwinds as after a Ctrl-C and
    MPI is finalized at exit (which removes the process's shared memory in /dev/shm; the default
    action left it there), then said in one line. relaunch() has its own handlers while a job runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_stop(signum, _frame) -> None:
    raise _Stopped(signum)


def omp_wait_policy(environ=os.environ) -> str | None:
    """The OpenMP wait policy for this process, or None to keep libgomp's default (spin briefly,
    about 300,000 rounds, then sleep).

    Ranks that share a host must not spin: a spinning team steals the core from the rank that
    computes next. A rank alone on its host, the cluster case, keeps the brief spin: with `passive`
    every one of the hundreds of barriers per token becomes a futex wake, which costs a rank with
    several threads much of its speed. A rank held to less than its CPUs by a cgroup quota (a
    container's or an emulated host's --cpus) never spins. An explicit OMP_WAIT_POLICY always wins. (BENCHMARKS.md,
    "OpenMP wait policy per rank" and "Figures formerly quoted in source comments".)"""
    from ..runtime.cpu_share import cpu_share
    from ..runtime.topology import WHOLE_HOST_ENV
    from ..transport.launch import RELAUNCHED, local_rank_count

    if "OMP_WAIT_POLICY" in environ:
        return None
    share = cpu_share()
    if share.quota_cpus is not None and share.quota_cpus < share.affinity_cpus:
        return "passive"  # held by a CPU quota: every spun cycle comes out of its own compute
    if environ.get(WHOLE_HOST_ENV) == "1":
        return "active"  # an iterative job's rank with its host's CPUs: GOMP_SPINCOUNT bounds the spin
    if local_rank_count(environ) > 1 or (environ.get(RELAUNCHED) and not environ.get("MPI_LOCALNRANKS")):
        return "passive"
    return None


# The commands that start a job (and check in with every rank at its start, transport/startup.py).
JOB_COMMANDS = ("generate", "chat", "serve", "bench", "calibrate")


def report_sigill(environ=os.environ) -> None:
    """A process that dies of SIGILL (ggml built with instructions this CPU does not run) says so in
    one line first. Not in the ranks of a job this command started: there the launching process
    reports the rank's signal (transport/launch.py, abnormal_end), once."""
    from ..errors import error_line, illegal_instruction
    from ..transport.launch import RELAUNCHED, under_mpi_launcher

    if environ.get(RELAUNCHED):
        return
    try:
        from .. import _native

        who = "a rank of this job" if under_mpi_launcher() else "pipeinfer"
        _native.report_sigill(error_line(illegal_instruction(who)) + "\n")
    except (ImportError, AttributeError):  # not built yet, or built before report_sigill existed
        pass


def say_interrupted() -> None:
    """The one line a Ctrl-C ends with. Under a launcher the user started (`mpiexec -n 2 pipeinfer
    …`) every rank is sent the Ctrl-C: rank 0 says it, the others end quietly."""
    from ..transport.start_waits import launcher_rank

    if launcher_rank() == 0:
        err.print("Error: interrupted")


def main() -> None:
    # Decided before libgomp loads (it reads the variable once).
    if (policy := omp_wait_policy()) is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
    from ..transport.launch import under_mpi_launcher

    if under_mpi_launcher():
        from ..transport.start_waits import arm_start_watchdog, sleep_while_starting

        sleep_while_starting()  # before MPI starts: its start-up waits must not spin
        if len(sys.argv) > 1 and sys.argv[1] in JOB_COMMANDS:
            arm_start_watchdog()  # a rank that never starts must not hang the job
    if len(sys.argv) > 1 and sys.argv[1] in JOB_COMMANDS:
        report_sigill()
    signal.signal(signal.SIGINT, _on_interrupt)
    if not under_mpi_launcher():  # a rank ends by SIGTERM's default: its launcher cleans up after it
        signal.signal(signal.SIGTERM, _on_stop)
    try:
        app()
    except KeyboardInterrupt:
        say_interrupted()
        raise SystemExit(130) from None
    except _Stopped as exc:
        with contextlib.suppress(OSError, ValueError):  # stderr may be gone
            err.print(f"Error: stopped by {signal.Signals(exc.signum).name}")
        raise SystemExit(128 + exc.signum) from None
    except SystemExit as exc:
        # Typer turns a KeyboardInterrupt inside a command into a silent exit status 130. (A job
        # started by relaunch() handles Ctrl-C itself and reports it: _interrupted stays False.)
        if _interrupted and exc.code == 130:
            say_interrupted()
        raise
    except Exception as exc:  # a bug: still one line unless PIPEINFER_DEBUG is set
        report(exc)
        raise SystemExit(1) from None

"""The parent of one rank of a `pipeinfer serve --ranks N` job: the rank's end, in words MPICH's
launcher does not act on.

Hydra's proxy kills every rank of its host at once when one of them dies by a signal (SIGKILL,
SIGTERM), even with -disable-auto-cleanup: the head would go with it, and its HTTP clients would see
their connections drop with no error. Under this guard a rank's death is an ordinary exit (status
128 + the signal), so the head lives on, notices the rank is gone and ends every request with an
error it can read (runtime/job.py). The guard says how its rank ended in a file of
PIPEINFER_RANK_ENDS, a directory the relaunching process made, where the head looks for it
(transport/liveness.py).

Run as `python -m pipeinfer_cli.transport.rank_guard COMMAND…`. Stop signals (SIGINT, SIGTERM,
SIGHUP; MPICH's SIGUSR1) are for the rank, which is signalled itself (a signal to the process group
reaches both): the guard ignores them and leaves when its rank has ended; a rank whose guard is
killed dies with it (PR_SET_PDEATHSIG). It imports nothing of pipeinfer.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

GUARD_NAME = b"pipeinfer-guard"  # the guard's process name: not a rank (process_tree.py)
ENDS_ENV = "PIPEINFER_RANK_ENDS"
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGPIPE)


def _rank() -> str:
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(key, "").isdigit():
            return os.environ[key]
    return "0"


def how_it_ended(status: int) -> str:
    """A waitpid status in words: 'exit status 1', 'killed by SIGKILL'."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, GUARD_NAME, 0, 0, 0)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the guard died before prctl took effect
                os._exit(1)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)

    for s in _IGNORED:  # they reach the rank itself; the guard leaves with it
        signal.signal(s, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    ends = os.environ.get(ENDS_ENV)
    if ends and code != 0:
        try:
            with open(os.path.join(ends, f"rank-{_rank()}.tmp"), "w") as f:
                f.write(how_it_ended(status) + "\n")
            os.replace(os.path.join(ends, f"rank-{_rank()}.tmp"), os.path.join(ends, f"rank-{_rank()}"))
        except OSError:
            pass
    return 128 - code if code < 0 else code  # a signal as the shell says it: 128 + its number


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

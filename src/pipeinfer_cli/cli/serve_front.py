"""`pipeinfer serve` as typed by a user (not inside an MPI job): the front (server/front.py) with the
HTTP server, started before anything slow so that /health answers "loading" at once, and the job
it supervises: its command line, its hosts, and how it is planned again over the hosts left."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

from ..runtime.service import Service
from ..server.front import Front, JobShape
from ..transport.host_probe import HOSTFILE_ENV, answering, host_name, hostfile_hosts, ranks_on
from .console import err


def say(line: str) -> None:
    err.print(line if line.startswith("Error: ") else f"pipeinfer serve: {line}", markup=False, highlight=False)


def job_shape(ranks: int, argv: list[str]) -> JobShape:
    """The job as the user asked for it: every rank runs this same command (sys.argv[1:])."""
    return JobShape(ranks=ranks, argv=list(argv), hostfile_hosts=hostfile_hosts())


def replan(shape: JobShape, lost_hosts: list[str]) -> JobShape:
    """The job over the hosts that still answer: the lost hosts' ranks dropped, their layers
    split again (--layer-split auto stays auto, on the profile; a split of fixed fractions goes
    back to the default, balanced by bytes). The job's own load checks whether the model still
    fits in the memory left (its error then ends the server)."""
    if not lost_hosts or not shape.hostfile_hosts:
        return shape
    left = [e for e in shape.hostfile_hosts if e not in lost_hosts]
    if not left:
        raise RuntimeError("no host of the hostfile answers")
    placed = ranks_on(shape.hostfile_hosts, shape.ranks)
    lost_names = {host_name(e) for e in lost_hosts}
    ranks = max(1, sum(1 for h in placed if h not in lost_names))
    with tempfile.NamedTemporaryFile("w", prefix="pipeinfer-serve-", suffix=".hosts", delete=False) as f:
        f.write("\n".join(left) + "\n")
    return JobShape(ranks=ranks, argv=_with_ranks(shape.argv, ranks), hostfile_hosts=left,
                    env={**shape.env, HOSTFILE_ENV: f.name})


def _with_ranks(argv: list[str], ranks: int) -> list[str]:
    """argv with --ranks N and without a --layer-split of fixed fractions (auto stays)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in ("--ranks", "-r"):
            i += 1 if eq else 2
            continue
        if name == "--layer-split":
            split = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if split.startswith("auto"):
                out += [a] if eq else argv[i:i + 2]
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    return out + ["--ranks", str(ranks)]


def run_front(service: Service, ranks: int, max_restarts: int, on_ready: Callable, tokenizer_for: Callable,
              on_front: Callable[[Front], None]) -> tuple[int, str | None]:
    """Serve until stopped: the exit status, and the name of the signal that stopped the server."""
    shape = job_shape(ranks, sys.argv[1:])
    front = Front(service, shape, say, max_restarts=max_restarts, replan=replan, on_ready=on_ready,
                  probe_hosts=answering, tokenizer_for=tokenizer_for)
    on_front(front)
    try:
        code = front.run()
    finally:
        planned = front.shape.env.get(HOSTFILE_ENV)  # a hostfile replan() wrote
        if planned and planned != os.environ.get(HOSTFILE_ENV):
            os.unlink(planned)
    return code or front.exit_code, front.stop_signal

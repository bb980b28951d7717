"""An MPI job that a long-lived process starts, watches and stops, and may start again: the job of
`pipeinfer serve`'s front (server/front.py).

Unlike `launch.relaunch`, which turns the calling command into the job and ends with it, this
leaves signals to the caller and returns at once: the caller asks whether the job is still there,
which rank ended first and how, and stops it by force, with nothing of it left (every process of
it, on this machine and through the launcher on the others, and its shared-memory files).
"""

from __future__ import annotations

import subprocess
import sys
import threading

from ..errors import debug_enabled
from .job_output import OutputPump
from .launch import _job_command, abnormal_end, start_own_session
from .process_tree import JobProcesses


class SupervisedJob:
    """One start of the job: `mpiexec -n N pipeinfer ARGV` with `env` added to its environment."""

    def __init__(self, n_ranks: int, argv: list[str], env: dict[str, str]):
        cmd, job_env = _job_command(n_ranks, argv)
        job_env.update(env)
        self.n_ranks = n_ranks
        self._stopping = threading.Event()
        self._proc = start_own_session(cmd, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.processes = JobProcesses(self._proc)
        debug = debug_enabled()
        self._pumps = (OutputPump(self._proc.stdout, sys.stdout.buffer, debug, self.stop, self._stopping),
                       OutputPump(self._proc.stderr, sys.stderr.buffer, debug, self.stop, self._stopping,
                                  drop_when_stopping=True))
        self._watched = threading.Event()
        threading.Thread(target=self.processes.watch_ranks, args=(n_ranks, self._watched), daemon=True,
                         name="find-ranks").start()
        self.rc: int | None = None

    def started(self) -> None:
        """Every rank has started (the head said it is ready): note the shared memory they map, which
        a rank killed later leaves behind, to remove it when the job ends."""
        self.processes.note_shared_memory()

    def running(self) -> bool:
        return self._proc.poll() is None

    @property
    def first_ended(self) -> list[int]:
        """The rank(s) that ended first, once one has (not when the job was stopped)."""
        return self.processes.first_to_end(self._pumps[0].failed_pid or self._pumps[1].failed_pid)

    def reported_error(self) -> bool:
        """The job printed an `Error:` line of its own (a failure it explained itself)."""
        return any(p.reported for p in self._pumps)

    @property
    def exit_string(self) -> str | None:
        """The launcher's account of how the first rank ended ("Killed (signal 9)"), once it has."""
        return self._pumps[0].exit_string or self._pumps[1].exit_string

    def how_it_ended(self) -> str:
        """One line on why the job ended, from the launcher's exit string (after wait())."""
        reason = self._pumps[0].exit_string or self._pumps[1].exit_string
        who = f"rank {self.first_ended[0]}" if len(self.first_ended) == 1 else None
        return abnormal_end(reason, self.rc if self.rc is not None else -1, None, who)

    def stop(self) -> None:
        """End every process of the job now (SIGTERM, SIGKILL soon after); returns at once."""
        self._stopping.set()
        self.processes.stop()

    def wait(self, timeout: float | None = None) -> int | None:
        """The launcher's exit status once every process of the job is gone; None if it is still
        running after `timeout` s."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self.rc is None:
            self._watched.set()
            # The job is over for good: shared memory that a killed rank (or one killed by the
            # launcher after it) could not remove goes too.
            self.rc = self.processes.finish(ended=True)
            for pump in self._pumps:
                pump.join(timeout=5)
        return self.rc

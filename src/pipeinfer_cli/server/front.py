"""`pipeinfer serve`'s front: the process that holds the HTTP server, the queue and every request's
committed tokens, outside the MPI job, so that the server outlives a lost rank, host or link.

It starts the job (transport/supervised_job.py), whose head connects back over the front channel
(transport/front_channel.py, runtime/engine.py), hands the head up to --parallel requests at a time,
and keeps, for each, the tokens whose text its client has received. When the job is lost (a rank
killed or crashed, a host or link gone silent past --rank-timeout) it stops what is left of it,
finds the hosts that still answer (transport/host_probe.py), starts the job again on them, and
resumes every request that was running from its committed tokens: greedy and seeded decoding are
functions of the tokens so far, so the client receives the rest of the very text it would have
received, with no gap and no repeat. Requests that were waiting just wait. At most --max-restarts
in RESTART_WINDOW_S; past that, every client is told and the server exits 1.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..runtime.engine import EngineInfo
from ..runtime.service import Service
from ..runtime.service_request import Event
from ..transport.front_channel import Channel, ChannelClosed, FrontListener
from .front_requests import RequestRouter
from ..transport.host_probe import host_name
from ..transport.supervised_job import SupervisedJob

RESTART_WINDOW_S = 600.0  # --max-restarts counts the restarts of the last ten minutes
STOP_WAIT_S = 5.0  # a job told to stop gets this long to end by itself, then it is stopped by force


@dataclass
class RecoveryStats:
    """What /health and /metrics say about restarts (read by the HTTP thread)."""

    restarts: int = 0
    resumed_requests: int = 0
    seconds_without_pipeline: float = 0.0
    hosts_lost: list[str] = field(default_factory=list)
    lost_at: float | None = None  # when the pipeline went, while it is being restarted

    def without_pipeline_s(self) -> float:
        return self.seconds_without_pipeline + (time.monotonic() - self.lost_at if self.lost_at else 0.0)


@dataclass
class JobShape:
    """How the job is started: its ranks, the command each rank runs and the hosts (None: this
    machine only); re-planned when hosts are lost."""

    ranks: int
    argv: list[str]
    hostfile_hosts: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


class JobLost(Exception):
    """The job ended or failed while serving: why, in one line."""


class Front:
    """The front of one `pipeinfer serve`: runs in the main thread until the server stops."""

    def __init__(self, service: Service, shape: JobShape, say: Callable[[str], None], max_restarts: int = 3,
                 replan: Callable[[JobShape, list[str]], JobShape] | None = None,
                 on_ready: Callable[[EngineInfo, bool], None] | None = None,
                 probe_hosts: Callable[[list[str]], list[str]] | None = None, tokenizer_for=None):
        self.service, self.shape, self.full_shape, self.say = service, shape, shape, say
        self.max_restarts, self.replan, self.on_ready = max_restarts, replan, on_ready
        self.probe_hosts, self.tokenizer_for = probe_hosts, tokenizer_for
        self.stats = RecoveryStats()
        self.listener = FrontListener(_connect_host(shape))
        self._restart_times: deque[float] = deque()
        self.requests = RequestRouter(service, self.stats, self._stopping)
        self._job: SupervisedJob | None = None
        self.stop_signal: str | None = None
        self._replan_all = False
        self.exit_code = 0

    # -- the main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until a stop signal (0), or until the job cannot be started or restarted (1)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        self.requests.start()
        first = True
        try:
            while self.stop_signal is None:
                self._job_ready = False
                try:
                    self._run_one_job(first)
                    break  # stopped in order
                except JobLost as lost:
                    job = self._job
                    if job is not None and not self._job_ready:
                        job.wait(STOP_WAIT_S)  # its own account of why it could not start
                    explained = job is not None and job.reported_error()
                    refused = job is not None and job.rc == 2  # a usage error: the model does not fit, …
                    if not self._ever_ready or (not self._job_ready and refused):
                        # The job could not start for a reason a restart would meet again (a rank
                        # lost while it starts is not one: that is restarted, within --max-restarts).
                        if not explained:
                            self.say(f"Error: {lost}")
                        self.service.fail(f"the server could not start its job: {lost}")
                        return self._job_exit_code() if not self._ever_ready else 1
                    if not self._recover(str(lost)):
                        return 1
                finally:
                    first = False
            return 0
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._end_job()
            self.listener.close()

    _ever_ready = False  # a job of this server has loaded
    _job_ready = False  # the current job has loaded

    def _run_one_job(self, first: bool) -> None:
        shape = self.shape
        self._job = job = SupervisedJob(shape.ranks, shape.argv, {**shape.env, **self.listener.env()})
        channel = self.listener.accept(timeout=float("inf"), give_up=lambda: not job.running() or self._stopping())
        if channel is None:
            if self._stopping():
                return
            job.wait(STOP_WAIT_S)
            raise JobLost(self._ended_line(job))
        self.requests.attach(channel)
        info = self._until_ready(channel, job)
        if info is None:
            return
        job.started()
        self._ready(info, first)
        self._serve(channel, job)

    def _until_ready(self, channel: Channel, job: SupervisedJob) -> EngineInfo | None:
        while True:
            if self._stopping():
                return None
            message = self._next(channel, job)
            if message is not None and message[0] == "ready":
                return message[1]

    def _ready(self, info: EngineInfo, first: bool) -> None:
        service = self.service
        if service.tokenizer is None and self.tokenizer_for is not None:
            service.attach(info.cfg, _FrontLoaded(self.tokenizer_for(info.cfg)))
        else:
            service.attach(info.cfg, service.loaded)
        self.info = info
        if self.stats.lost_at is not None:
            self.stats.seconds_without_pipeline += time.monotonic() - self.stats.lost_at
            self.stats.lost_at = None
        if self.on_ready is not None:
            self.on_ready(info, self._ever_ready)
        self._ever_ready = self._job_ready = True
        if service.status == "loading":
            service.mark_ready()
        service.resume_serving()

    def _serve(self, channel: Channel, job: SupervisedJob) -> None:
        """Route the head's events until the server stops (returns) or the job is lost (JobLost)."""
        while True:
            if self._replan_all:
                self._replan_all = False
                raise JobLost("SIGHUP: the job is planned again over every host")
            if self._stopping():
                self._stop_job_in_order(channel, job)
                return
            message = self._next(channel, job)
            if message is not None and message[0] == "event":
                self.requests.event(message[1], message[2])
            elif message is not None and message[0] == "slots":
                self.requests.slot_answer(message[1], message[2])

    def _next(self, channel: Channel, job: SupervisedJob) -> tuple | None:
        """The head's next message (None: none within a moment); JobLost once the job failed (the
        head said why), its channel closed or its launcher ended."""
        try:
            message = channel.recv(timeout=0.2)
        except ChannelClosed:
            raise JobLost(self._ended_line(job)) from None
        if message is None and not job.running():
            raise JobLost(self._ended_line(job))
        if message is not None and message[0] == "failed":
            raise JobLost(message[1])
        return message

    # -- losing and restarting the job --------------------------------------------------------------
    def _recover(self, why: str) -> bool:
        """After the job was lost: stop what is left of it, plan the next one and hand the running
        requests back to the queue. False when no restart is allowed (every client told)."""
        now = time.monotonic()
        self.stats.lost_at = self.stats.lost_at or now
        self.service.pause(f"the pipeline is being restarted: {why}")
        self._end_job()
        running = self.requests.take_running()
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            allowed = ("no restart" if self.max_restarts == 0 else
                       f"{self.max_restarts} restarts in {int(RESTART_WINDOW_S // 60)} minutes, all used")
            message = f"{why}; the server stops (--max-restarts {self.max_restarts}: {allowed})"
            self.say(f"Error: {message}")
            self.service.fail(message)
            self.exit_code = 1
            return False
        self._restart_times.append(now)
        self.stats.restarts += 1
        self.service.requeue(running)
        resumed = sum(1 for t in running if self.requests.committed(t))
        shape = self.full_shape if why.startswith("SIGHUP") else self.shape
        lost_hosts: list[str] = []
        if shape.hostfile_hosts and self.probe_hosts is not None:
            answering = self.probe_hosts(shape.hostfile_hosts)
            lost_hosts = [h for h in shape.hostfile_hosts if h not in answering]
        self.stats.hosts_lost = [host_name(h) for h in lost_hosts]
        if self.replan is not None:
            try:
                shape = self.replan(shape, lost_hosts)
            except Exception as exc:  # noqa: BLE001 - the job cannot run on what is left: one line, every client told
                self.say(f"Error: the job cannot be started again: {exc}")
                self.service.fail(f"the server stops: {exc}")
                self.exit_code = 1
                return False
        self.shape = shape
        self.say(f"{why}; starting the job again on {shape.ranks} rank{'s' if shape.ranks != 1 else ''}"
                 + (f" (hosts lost: {', '.join(self.stats.hosts_lost)})" if lost_hosts else "")
                 + f", restart {len(self._restart_times)} of at most {self.max_restarts} in "
                 f"{int(RESTART_WINDOW_S // 60)} minutes; {len(running)} request{'s' if len(running) != 1 else ''} "
                 f"in flight ({resumed} resumed from their committed tokens), {self.service.queue_depth() - len(running)} "
                 "waiting")
        return True

    def _end_job(self) -> None:
        channel, job = self.requests.attach(None), self._job
        if channel is not None:
            channel.close()
        if job is not None:
            if job.running():
                job.stop()
            job.wait()

    def _stop_job_in_order(self, channel: Channel, job: SupervisedJob) -> None:
        """A stop signal: every request ends with an error (the service's stop), the head is told to
        stop and the job ends by itself, or by force after STOP_WAIT_S."""
        job.started()  # the shared memory its ranks map now, removed once they are gone
        self.requests.send(channel, "stop", f"the server is shutting down ({self.stop_signal})")
        deadline = time.monotonic() + STOP_WAIT_S
        while job.running() and time.monotonic() < deadline:
            try:
                message = channel.recv(timeout=0.1)
            except ChannelClosed:
                break
            if message is not None and message[0] == "event":
                self.requests.event(message[1], message[2])
        left = self.requests.take_running()
        for t in left:
            t.emit(Event("error", text=f"the server is shutting down ({self.stop_signal})", reason="stopping"))

    def _ended_line(self, job: SupervisedJob) -> str:
        """Which rank ended and how, named as the head named it: 'rank 2 (stage 3 of 4, host h3)
        ended: killed by SIGKILL'; else the launcher's account of the end."""
        job.wait(STOP_WAIT_S)
        info = getattr(self, "info", None)
        ended = job.first_ended
        by = re.search(r"signal (\d+)", job.exit_string or "")
        if len(ended) != 1:
            return job.how_it_ended()
        name = info.rank_names[ended[0]] if info is not None and ended[0] < len(info.rank_names) else f"rank {ended[0]}"
        if by is not None:
            try:
                return f"{name} ended: killed by {signal.Signals(int(by[1])).name}"
            except ValueError:
                pass
        return job.how_it_ended().replace(f"rank {ended[0]} ended first", f"{name} ended first", 1)

    def _job_exit_code(self) -> int:
        job = self._job
        rc = job.wait(STOP_WAIT_S) if job is not None else 1
        return 2 if rc == 2 else 1

    # -- signals ------------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGHUP and self._ever_ready and self.stop_signal is None:
            self._replan_all = True
            return
        if self.stop_signal is None:
            self.stop_signal = signal.Signals(signum).name
            threading.Thread(target=self.service.stop, args=(f"the server is shutting down ({self.stop_signal})",),
                             daemon=True).start()

    def _stopping(self) -> bool:
        return self.stop_signal is not None


@dataclass
class _FrontLoaded:
    """What the front's service reads of a loaded job: the tokenizer (its own copy, vocabulary only)."""

    tokenizer: object


def _connect_host(shape: JobShape) -> str:
    from ..transport.front_channel import address_towards

    return address_towards(host_name(shape.hostfile_hosts[0]) if shape.hostfile_hosts else None)

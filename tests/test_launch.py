"""The relaunch wrapper: Hydra's BAD TERMINATION banner goes, everything else streams; a stop
(Ctrl-C, SIGTERM) ends every process of the job and leaves only `Error: interrupted`."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from jobprocs import job_env, marked_pids
from pipeinfer_cli.transport.launch import BannerFilter, LauncherFilter

BANNER = b"""
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 30425 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""


def filtered(data: bytes, step: int) -> tuple[bytes, BannerFilter]:
    f = BannerFilter()
    out = b"".join(f.feed(data[i:i + step]) for i in range(0, len(data), step))
    return out + f.close(), f


@pytest.mark.parametrize("step", [1, 2, 5, 64, 1 << 16])
@pytest.mark.parametrize("data, want", [
    (b" Paris. The", b" Paris. The"),
    (b"Paris.\n\nThe end\n\n", b"Paris.\n\nThe end\n\n"),
    (b"a = 1\n==> x\n=\n=====\nPlease note\nThis typically\nYOUR APP", b"a = 1\n==> x\n=\n=====\nPlease note\nThis typically\nYOUR APP"),
    # Text that looks like parts of the banner stays: only the whole banner goes.
    (b"Title\n" + b"=" * 40 + b"\n\n" + b"=" * 40 + b"\n" + b"=" * 40 + b"\n=   BAD\nPlease see the FAQ page for debugging suggestions\n",
     b"Title\n" + b"=" * 40 + b"\n\n" + b"=" * 40 + b"\n" + b"=" * 40 + b"\n=   BAD\nPlease see the FAQ page for debugging suggestions\n"),
    (b"x" + BANNER + b"after\n", b"x\nafter\n"),
    (b"x\n" + BANNER + BANNER + b"\n\n", b"x\n\n\n"),
    (BANNER, b""),
    (b"|partial" + BANNER, b"|partial\n"),
    (b"Error: rank 1: boom\n" + BANNER, b"Error: rank 1: boom\n"),
])
def test_banner_is_removed_and_text_kept(data, want, step):
    out, f = filtered(data, step)
    assert out == want
    if BANNER in data:
        assert f.exit_string == "Killed (signal 9)" and f.failed_pid == 30425
    else:
        assert f.failed_pid is None


def test_ranks_that_ended_together_are_told_apart_by_the_pid_the_launcher_saw_fail():
    from pipeinfer_cli.transport.process_tree import JobProcesses

    job = JobProcesses(None)
    job.ranks = {101: 0, 102: 1, 103: 2}
    job.first_ended = [1, 2]  # both gone between two looks of the watcher
    assert job.first_to_end(103) == [2]
    assert job.first_to_end(None) == [1, 2] and job.first_to_end(101) == [1, 2]  # not one of them
    job.first_ended = [1]
    assert job.first_to_end(103) == [1]  # one rank ended first: the launcher's later view does not change it


@pytest.mark.parametrize("step", [1, 3, 7, 1 << 16])
def test_an_error_line_is_seen_when_it_arrives_in_pieces(step):
    """A rank's `Error:` line can reach the launcher in several reads on a loaded machine; the
    launcher must still see that the job reported its error (else it adds a second line)."""
    _, f = filtered(b"The capital\nError: rank 0 (the head) sent nothing for 3 s\n" + BANNER, step)
    assert any(line.startswith(b"Error: rank 0") for line in f.lines)
    _, f = filtered(b"The capital\nno error here\n", step)
    assert not any(line.startswith(b"Error: ") for line in f.lines)


@pytest.mark.parametrize("pieces, reported", [
    # What the output pump concludes, with pieces in separate reads: a rank's print() may reach the
    # launcher as the text, then its newline (seen in the fault matrix).
    ([b"pipeinfer: 32 tokens\n", b"Error: rank 0 made no progress", b"\n"], True),
    ([b"Err", b"or: rank 2 failed\n"], True),
    ([b"text\nError: rank 1 failed\n"], True),
    ([b"the words Error: x in a line\n", b"Error", b"\n"], False),
])
def test_the_pump_sees_an_error_line_that_arrives_in_pieces(pieces, reported):
    import io
    import threading

    from pipeinfer_cli.transport.job_output import OutputPump

    r, w = os.pipe()
    dst = io.BytesIO()
    with open(r, "rb", buffering=0) as src:
        pump = OutputPump(src, dst, False, lambda: None, threading.Event())
        for piece in pieces:
            os.write(w, piece)
            time.sleep(0.05)  # separate reads, as from the launcher (the check holds either way)
        os.close(w)
        pump.join(timeout=10)
    assert dst.getvalue() == b"".join(pieces)
    assert pump.reported is reported


def test_text_is_not_held_back():
    f = BannerFilter()
    assert f.feed(b" Paris") == b" Paris"  # a streamed token is written at once
    assert f.feed(b".\nThe") == b".\nThe"
    assert f.feed(b"\n=") == b"\n"  # only a possible banner line waits for its end
    assert f.feed(b"> x") == b"=> x"
    assert f.feed(b"\n" + b"=" * 30) == b"\n"
    assert f.feed(b"\nok") == b"=" * 30 + b"\nok"


# -- stopping the job ---------------------------------------------------------------------------

@pytest.mark.parametrize("step", [1, 3, 1 << 16])
@pytest.mark.parametrize("data, want", [
    (b"[mpiexec@vm] Sending Ctrl-C to processes as requested\n[mpiexec@vm] Press Ctrl-C again to force abort\n", b""),
    (b'{"text": "a"}\n[proxy:0@vm] HYD_pmcd_pmip_control_cmd_cb (proxy/pmip_cb.c:1) assert (!closed) failed\n', b'{"text": "a"}\n'),
    (b" The capital[mpiexec@vm] Sending Ctrl-C to processes as requested\n", b" The capital"),
    (b"text [mpi and [prox stay\n", b"text [mpi and [prox stay\n"),
    (b"ends with [", b"ends with ["),
    (b"[proxy:0@vm] no newline at the end", b""),
])
def test_launcher_messages_are_removed(data, want, step):
    f = LauncherFilter()
    out = b"".join(f.feed(data[i:i + step]) for i in range(0, len(data), step)) + f.close()
    assert out == want


def test_launcher_filter_holds_back_only_a_possible_prefix():
    f = LauncherFilter()
    assert f.feed(b" Paris") == b" Paris"
    assert f.feed(b". [m") == b". "
    assert f.feed(b"x]") == b"[mx]"


# A stand-in for Hydra's mpiexec: one "rank" that ignores SIGINT and SIGTERM (like a rank busy in C
# code, loading a model), started in a session of its own as Hydra starts its ranks, with an MPICH
# shared-memory file mapped; and Hydra's reactions to signals, printed where Hydra prints them.
FAKE_MPIEXEC = r'''
import signal, subprocess, sys, time
ready, marker, shm = sys.argv[1], sys.argv[2], sys.argv[3]
def chatter(signum, frame):
    if signum == signal.SIGINT:
        print("[mpiexec@vm] Sending Ctrl-C to processes as requested", flush=True)
        print("[mpiexec@vm] Press Ctrl-C again to force abort", flush=True)
    print("[proxy:0@vm] HYD_pmcd_pmip_control_cmd_cb (proxy/pmip_cb.c:1) assert (!closed) failed", file=sys.stderr, flush=True)
signal.signal(signal.SIGINT, chatter)
signal.signal(signal.SIGTERM, chatter)
rank = subprocess.Popen([sys.executable, "-c",
    "import mmap, signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "f = open(sys.argv[2], 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096);"
    "sys.stdout.write(' The capital'); sys.stdout.flush(); open(sys.argv[1], 'w').close(); time.sleep(60)",
    ready, shm, marker], start_new_session=True)
rank.wait()
'''

def job_processes(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if marker.encode() in cmdline:
                pids.append(int(entry))
    return pids


def _fake_mpiexec(tmp_path: Path) -> Path:
    """An executable `mpiexec` that runs the Python script given after `--fake` (a stand-in job)."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!" + sys.executable + "\nimport sys, runpy\n"
                    "args = sys.argv[sys.argv.index('--fake') + 1:]\n"
                    "sys.argv = args\nrunpy.run_path(args[0], run_name='__main__')\n")
    fake.chmod(0o755)
    return fake


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/stat").exists(), reason="Linux: reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_leaves_clean_output_and_no_process(tmp_path, signum):
    fake = _fake_mpiexec(tmp_path)
    (tmp_path / "fake_mpiexec.py").write_text(FAKE_MPIEXEC)
    ready = tmp_path / "ready"
    marker = f"pipeinfer-test-{uuid.uuid4().hex}"
    shm = Path("/dev/shm") / f"mpich_{marker}"
    args = [str(tmp_path / "fake_mpiexec.py"), str(ready), marker, str(shm)]
    wrapper = (f"import sys\nfrom pipeinfer_cli.transport import launch\n"
               f"launch.find_mpiexec = lambda: {str(fake)!r}\n"
               f"sys.exit(launch.relaunch(2, ['--fake', *{args!r}]))\n")
    # Its own session, like a command in a terminal: the signal goes to the whole foreground
    # process group, as a Ctrl-C at the terminal (or `timeout -s INT`) sends it.
    p = subprocess.Popen([sys.executable, "-c", wrapper], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        assert job_processes(marker)
        os.killpg(p.pid, signum)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    name = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert (p.returncode, out, err) == (128 + signum, b" The capital", f"Error: {name}\n".encode())
    assert job_processes(marker) == []  # the rank that ignored SIGTERM is gone when the command ends
    assert not shm.exists()  # and the shared memory the killed rank left is removed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a shebang script")
def test_launcher_failure_is_one_error_line_with_its_message(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho '[mpiexec@vm] HYDU_create_process (lib/utils/launch.c:74): execvp error' >&2\nexit 255\n")
    fake.chmod(0o755)
    wrapper = (f"import sys\nfrom pipeinfer_cli.transport import launch\n"
               f"launch.find_mpiexec = lambda: {str(fake)!r}\nsys.exit(launch.relaunch(2, []))\n")
    r = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, timeout=30)
    assert r.returncode == 255
    assert r.stderr.decode().splitlines() == [
        "Error: the MPI launcher failed (mpiexec exit status 255): "
        "[mpiexec@vm] HYDU_create_process (lib/utils/launch.c:74): execvp error"]


def test_launcher_teardown_chatter_is_not_blamed():
    from pipeinfer_cli.transport.launch import abnormal_end

    msg = abnormal_end(None, 9, ["[proxy:0@vm] HYD_pmcd_pmip_control_cmd_cb (...): assert (!closed) failed"])
    assert "crashed or was killed" in msg and "assert" not in msg


@pytest.mark.parametrize("reason, want, not_want", [
    ("Killed (signal 9)", "killed (SIGKILL), for example by the out-of-memory killer", "SIGTERM"),
    ("Terminated (signal 15)", "stopped (SIGTERM) by someone or something: a scheduler", "out-of-memory"),
    ("Segmentation fault (signal 11)", "a rank crashed", "out-of-memory"),
])
def test_the_cause_named_fits_the_signal(reason, want, not_want):
    """The out-of-memory killer sends SIGKILL: it is never offered as the cause of a SIGTERM."""
    from pipeinfer_cli.transport.launch import abnormal_end

    msg = abnormal_end(reason, 143)
    assert want in msg and not_want not in msg and reason in msg, msg


def test_a_rank_dead_of_sigill_is_told_to_rebuild_ggml_portable():
    from pipeinfer_cli.transport.launch import abnormal_end

    msg = abnormal_end("Illegal instruction (signal 4)", 132, None, "rank 1")
    assert msg.startswith("the MPI job ended abnormally (rank 1 ended first; Illegal instruction (signal 4), "
                          "mpiexec exit status 132): a rank died of SIGILL (illegal instruction)")
    assert "AMX" in msg and msg.endswith("`PIPEINFER_GGML_PORTABLE=1 make install` in the pipeinfer checkout")
    assert "SIGILL" not in abnormal_end("Killed (signal 9)", 9) and "SIGILL" not in abnormal_end("Killed (signal 40)", 9)


def test_a_process_dead_of_sigill_says_so_in_one_line():
    """A 1-rank job runs in the `pipeinfer` process: its SIGILL handler (native, async-signal-safe)
    writes the Error: line, then the process dies of SIGILL as it would have."""
    code = ("import os, signal; from pipeinfer_cli.cli.app import report_sigill; report_sigill({}); "
            "os.kill(os.getpid(), signal.SIGILL); print('survived')")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PIPEINFER_RELAUNCHED", "OMPI_"))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == -signal.SIGILL and r.stdout == ""
    assert r.stderr.splitlines() == [
        "Error: pipeinfer died of SIGILL (illegal instruction): llama-cpp-python's ggml, which the native engine "
        "shares, was built with instructions this CPU does not run (ggml's AMX kernels, where AMX is reported but "
        "not enabled, as in some VMs); rebuild it portable with `PIPEINFER_GGML_PORTABLE=1 make install` in the "
        "pipeinfer checkout"]


# -- Ctrl-C on a real job (mpiexec of the mpich wheel, SmolLM2 on 2 ranks) --------------------------

def rank_pids(marker: str) -> list[int]:
    return [p for p in marked_pids(marker) if b"PMI_RANK=" in Path(f"/proc/{p}/environ").read_bytes()]


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="Linux: reads /proc")
@pytest.mark.parametrize("phase", ["loading", "decoding"])
def test_ctrl_c_leaves_only_results_and_ends_the_job(smollm2_path, phase):
    """`pipeinfer generate … --ranks 2 --json > out.json`, Ctrl-C: stdout holds only results, stderr
    one `Error: interrupted`, exit status 130, and no process of the job is left when it returns."""
    marker = uuid.uuid4().hex
    env = job_env(marker)
    json_flag = ["--json"] if phase == "loading" else []
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--ranks", "2", "-n", "3000",
           "--ctx", "4096", "--threads", "1", "-p", "The quick brown fox", *json_flag]
    # Its own session: the signal goes to the whole foreground process group, as from a terminal.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        if phase == "loading":  # as soon as both ranks exist: they are importing and loading the model
            while len(rank_pids(marker)) < 2:
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.01)
        else:  # the first streamed text
            first = os.read(p.stdout.fileno(), 1 << 16)
            assert first
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        left = marked_pids(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert (p.returncode, err) == (130, b"Error: interrupted\n")
    assert left == []  # gone when the command returns
    assert b"[mpiexec@" not in out and b"[proxy:" not in out and b"Ctrl-C" not in out
    if phase == "loading":
        assert out == b"" or json.loads(out)
    # The job is killed, not waited for: a rank busy loading a model used to keep it for 10 s.
    assert took < 5, took


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="Linux: reads /proc")
def test_ctrl_c_on_one_rank_says_interrupted(smollm2_path):
    """Without relaunch (one rank, in this process), Ctrl-C while decoding: one line, status 130."""
    marker = uuid.uuid4().hex
    env = job_env(marker)
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "-n", "3000", "--ctx", "4096",
           "--threads", "1", "-p", "The quick brown fox"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        assert os.read(p.stdout.fileno(), 1 << 16)  # decoding
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (p.returncode, err.decode()) == (130, "Error: interrupted\n")
    assert marked_pids(marker) == []


# A stand-in for mpiexec and two ranks (PMI_RANK set, as Hydra sets it), for a server's orderly stop:
# each rank notes the signals it receives; rank 1 ends when rank 0 has ended (as a stage ends when
# the head tells it to). With "stubborn", rank 0 ignores SIGTERM (a head stuck in C code).
@pytest.mark.parametrize("environ, want", [
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, 2),  # MPICH's Hydra
    ({"OMPI_COMM_WORLD_SIZE": "3"}, 3),  # Open MPI
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, 4),  # srun
    ({"SLURM_NTASKS": "4"}, None),  # an allocation (sbatch) is not a step of 4 ranks
    ({}, None),
])
def test_the_launchers_rank_count(environ, want):
    from pipeinfer_cli.transport.start_waits import launcher_size

    assert launcher_size(environ) == want


def test_a_job_started_by_the_users_mpiexec_plans_for_its_ranks(monkeypatch):
    """`mpiexec -n 2 pipeinfer generate … --layer-split auto` without --ranks: -M auto and
    --layer-split auto plan (and name the calibration) for 2 ranks, not 1."""
    from pipeinfer_cli.cli.job_setup import ranks_wanted

    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    assert ranks_wanted(None, None) == (1, None)  # no launcher: one rank
    monkeypatch.setenv("PMI_SIZE", "2")
    assert ranks_wanted(None, None) == (2, None)
    assert ranks_wanted(3, None) == (3, None) and ranks_wanted(None, "0.5,0.5/1") == (3, 3)  # options win


def test_a_ctrl_c_under_the_users_mpiexec_is_said_once_by_rank_0(monkeypatch, capsys):
    """Every rank of `mpiexec -n 2 pipeinfer …` is sent the Ctrl-C; one line, not one per rank."""
    from pipeinfer_cli.cli.app import say_interrupted

    monkeypatch.setenv("PMI_RANK", "1")
    say_interrupted()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PMI_RANK", "0")
    say_interrupted()
    assert capsys.readouterr().err == "Error: interrupted\n"


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/maps").exists(), reason="Linux: reads /proc")
def test_a_one_rank_job_stopped_by_sigterm_says_so_and_leaves_no_shared_memory(smollm2_path):
    """SIGTERM's default action ended the process without MPI_Finalize: its MPICH shared-memory
    file stayed in /dev/shm, and nothing was said."""
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "-n", "3000", "--ctx", "4096",
           "--threads", "1", "-p", "The quick brown fox"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=job_env(marker),
                         start_new_session=True)
    try:
        assert os.read(p.stdout.fileno(), 1 << 16)  # decoding
        shm = {Path(line.split(None, 5)[5].strip()) for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines()
               if "/dev/shm/mpich_" in line}
        os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (p.returncode, err.decode()) == (143, "Error: stopped by SIGTERM\n")
    assert shm and [f for f in shm if f.exists()] == []

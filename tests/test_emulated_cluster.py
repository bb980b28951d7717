"""The emulated cluster (scripts/emulate-cluster.sh): real `pipeinfer generate` jobs with one rank
per "host" (a network namespace with its own hostname), over TCP through rate-limited veth links.

- 2 and 3 hosts, iterative / speculative / pipeinfer, greedy and `--temp 0.8 --seed 7`: the tokens
  equal those of the same job over shared memory (`--ranks N` on this machine).
- The bytes cross the shaped links: each host's link counters grow by at least the bytes its rank
  reports sending and receiving, and an 8 MiB MPI send over a 10 Mbit/s link takes over 5 s.
- A rank that fails or is killed on another host ends the job promptly with one `Error:` line.
- `down`, and an interrupted `run`, leave no namespace, link, /etc/hosts line, state or process.

Links are rate-limited only: the kernel has no netem, so no latency is emulated.
Needs root and working `ip netns`; otherwise the whole file is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from jobprocs import assert_no_survivors, finish_job, job_env, start_job, wait_first_output
from tinygguf import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "emulate-cluster.sh"
HOSTS_FILE = Path("/etc/hosts")
STATE_ROOT = Path("/run/pipeinfer-emulate-cluster" if Path("/run").is_dir() else "/tmp/pipeinfer-emulate-cluster")
# Names unique per test session (the pid), so that concurrent sessions on one machine never meet.
_ID = os.getpid() % 10000

PROMPT = "The capital of France is"
COMMON = ["-p", PROMPT, "-n", 16, "--ctx", 256, "--threads", 1, "--json"]
SAMPLING = {"greedy": [], "temp0.8-seed7": ["--temp", "0.8", "--seed", "7"]}
MODES = {"iterative": [], "speculative": ["--draft", "lookup"], "pipeinfer": ["--draft", "smollm2-135m-instruct"]}


def _unusable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veths, tc)"
    for tool in ("ip", "tc", "unshare"):
        if not shutil.which(tool):
            return f"the emulated cluster needs `{tool}`"
    probe = f"pt{_ID}p-h99"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[0]
        return f"`ip netns add` does not work here: {why}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_WHY = _unusable()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


# -- the cluster ----------------------------------------------------------------------------------

class Emu:
    def __init__(self, n: int, prefix: str, subnet: str):
        self.n, self.prefix, self.subnet = n, prefix, subnet

    def cmd(self, *args) -> list[str]:
        return [str(SCRIPT), "--prefix", self.prefix, "--subnet", self.subnet, *map(str, args)]

    def host(self, k: int) -> str:
        return f"{self.prefix}-h{k}"

    def counters(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) by each host, from the host-side veth's statistics."""
        out = []
        for k in range(self.n):
            stats = Path("/sys/class/net") / self.host(k) / "statistics"
            out.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
        return out

    def pids(self) -> list[int]:
        pids = []
        for k in range(self.n):
            r = subprocess.run(["ip", "netns", "pids", self.host(k)], capture_output=True, text=True)
            pids += [int(p) for p in r.stdout.split()]
        return pids


def leftovers(prefix: str) -> list[str]:
    """Anything of the cluster `prefix` that still exists."""
    pat = re.compile(re.escape(prefix) + r"-(br|h\d+p?)$")
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = re.findall(r"^\d+: ([^:@]+)", subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                                          text=True).stdout, re.M)
    marker = f"# pipeinfer emulate-cluster {prefix}"
    left = [f"netns {n.split()[0]}" for n in ns if n.strip() and pat.match(n.split()[0])]
    left += [f"link {name}" for name in links if pat.match(name)]
    left += [f"hosts line {line!r}" for line in HOSTS_FILE.read_text().splitlines() if line.endswith(marker)]
    if (STATE_ROOT / prefix).exists():
        left.append(f"state {STATE_ROOT / prefix}")
    return left


_taken: set[str] = set()


def free_subnet() -> str:
    """A 10.214.X.0/24 that no route of this machine (another cluster's bridge) uses yet."""
    routes = subprocess.run(["ip", "-4", "-o", "route", "show"], capture_output=True, text=True).stdout
    for x in range(250):
        net = f"10.214.{x}.0/24"
        if net not in _taken and f"10.214.{x}." not in routes:
            _taken.add(net)
            return net
    pytest.fail("no free 10.214.X.0/24 subnet for an emulated cluster")


def _up(n: int, prefix: str, rate: str = "100mbit"):
    emu = Emu(n, prefix, free_subnet())
    # The prefix holds this session's pid: a cluster with it was left by a dead session.
    subprocess.run(emu.cmd("down"), capture_output=True, timeout=60)
    r = subprocess.run(emu.cmd("up", n, "--rate", rate), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        yield emu
    finally:
        pids = emu.pids()
        r = subprocess.run(emu.cmd("down"), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert leftovers(prefix) == []
        assert not [p for p in pids if Path(f"/proc/{p}").exists()], "processes left in the namespaces"


@pytest.fixture(scope="module")
def cluster2():
    yield from _up(2, f"pt{_ID}a")


@pytest.fixture(scope="module")
def cluster3():
    yield from _up(3, f"pt{_ID}b")


@pytest.fixture
def clusters(request):
    return lambda n: request.getfixturevalue(f"cluster{n}")


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    """A tiny random model: it never stops by itself, so a long job lasts as long as needed."""
    return write_tiny_model(tmp_path_factory.mktemp("emu") / "tiny.gguf", arch="qwen2", n_layer=4, seed=0)


def generate(model: Path, n_ranks: int, mode: str, sampling: str, emu: Emu | None = None) -> tuple[dict, list]:
    """One --json job: over shared memory, or on the emulated cluster (with the link counters'
    growth per host)."""
    args = [sys.executable, "-m", "pipeinfer_cli", "generate", model, *COMMON, "--ranks", n_ranks,
            "--mode", mode, *MODES[mode], *SAMPLING[sampling]]
    args = list(map(str, args))
    marker = uuid.uuid4().hex
    if emu is not None:
        args = emu.cmd("exec", "--", *args)
        before = emu.counters()
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=180, env=job_env(marker))
    finally:
        assert_no_survivors(marker)
    assert r.returncode == 0, r.stderr
    grew = [(s1 - s0, r1 - r0) for (s0, r0), (s1, r1) in zip(before, emu.counters())] if emu else []
    return json.loads(r.stdout), grew


# -- the hosts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3])
def test_each_rank_runs_on_its_own_host(clusters, n):
    emu = clusters(n)
    r = subprocess.run(emu.cmd("mpiexec", "--", "hostname"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == [emu.host(k) for k in range(n)]
    # Each name resolves to its namespace's own address.
    for k in range(n):
        addr = subprocess.run(["getent", "hosts", emu.host(k)], capture_output=True, text=True).stdout.split()[0]
        inside = subprocess.run(["ip", "-n", emu.host(k), "-4", "-o", "addr", "show", "eth0"],
                                capture_output=True, text=True).stdout
        assert f" {addr}/" in inside


# -- identical tokens -----------------------------------------------------------------------------

_shm: dict[tuple, dict] = {}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [2, 3])
def test_tokens_equal_shared_memory_and_bytes_cross_the_links(smollm2_path, clusters, n, mode, sampling):
    emu = clusters(n)
    got, grew = generate(smollm2_path, n, mode, sampling, emu)
    key = (n, mode, sampling)
    if key not in _shm:
        _shm[key], _ = generate(smollm2_path, n, mode, sampling)
    want = _shm[key]
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    assert len(got["tokens"]) > 0
    # Rank k runs on host k: its link carried at least what it reports having sent and received.
    sent, received = [0] * n, [0] * n
    for link in got["wire"]["links"]:
        sent[link["from"]] += link["bytes"]
        received[link["to"]] += link["bytes"]
    assert sum(sent) > 0
    for k in range(n):
        assert grew[k][0] >= sent[k] and grew[k][1] >= received[k], (k, grew, sent, received)


# -- the model on the head's host only -----------------------------------------------------------

def _node_local_cache(tmp_path: Path, n: int, *models: Path) -> Path:
    """A cache directory that is node-local on the emulated hosts (PIPEINFER_EMU_NODE_LOCAL): the
    head's host holds these model files, every other host starts empty."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for m in models:
        os.link(m, cache / m.name)
    for k in range(1, n):
        shutil.rmtree(f"{cache}.{_host_of(k, n)}", ignore_errors=True)
    return cache


def _host_of(k: int, n: int) -> str:
    return f"pt{_ID}{'a' if n == 2 else 'b'}-h{k}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [2, 3])
def test_a_model_on_the_head_alone_gives_the_tokens_of_shared_memory(smollm2_path, clusters, tmp_path, n, mode):
    """The model is on the head's host only (other hosts have their own, empty cache): every
    other rank is sent its layers over its shaped link, and the tokens are those of the same job
    over shared memory. The next job reads the slices from the hosts' caches: nothing is sent."""
    emu = clusters(n)
    cache = _node_local_cache(tmp_path, n, smollm2_path)
    env_extra = {"PIPEINFER_CACHE": str(cache), "PIPEINFER_EMU_NODE_LOCAL": str(cache)}
    args = [sys.executable, "-m", "pipeinfer_cli", "generate", "smollm2-135m-instruct", *COMMON, "--ranks", n,
            "--mode", mode, *MODES[mode], "--no-pull"]
    key = (n, mode, "greedy")
    if key not in _shm:
        _shm[key], _ = generate(smollm2_path, n, mode, "greedy")
    for round_ in ("streamed", "cached"):
        marker = uuid.uuid4().hex
        before = emu.counters()
        try:
            r = subprocess.run(emu.cmd("exec", "--", *map(str, args)), capture_output=True, text=True, timeout=180,
                               env=job_env(marker, **env_extra))
        finally:
            assert_no_survivors(marker)
        assert r.returncode == 0, r.stderr
        grew = [s1 - s0 for (s0, _), (s1, _) in zip(before, emu.counters())]
        got = json.loads(r.stdout)
        assert got["tokens"] == _shm[key]["tokens"] and got["text"] == _shm[key]["text"]
        weights = [rank["weights"] for rank in got["ranks"]]
        assert weights[0]["source"] == "local"
        if round_ == "streamed":
            assert all(w["source"] == "stream" and w["bytes_received"] > 5_000_000 for w in weights[1:]), weights
            assert grew[0] >= sum(w["bytes_received"] for w in weights[1:])  # through the head's shaped link
        else:
            assert all(w["source"] == "cache" and w["bytes_received"] == 0 for w in weights[1:]), weights
            assert grew[0] < 5_000_000, grew  # the job's own traffic only
    assert not list(Path(f"{cache}.{_host_of(1, n)}").glob("*.gguf"))  # slices only, in slices/


def test_calibrate_with_the_model_on_the_head_alone(smollm2_path, cluster2, tmp_path):
    """calibrate on 2 hosts, the model on the head's only: host 1 is sent the model over its link
    (the probe's slice holds every layer of SmolLM2), the profile has both ranks' rows measured on their own hosts, and the next
    calibration reads host 1's node cache."""
    from pipeinfer_cli.planner.identity import model_sha256
    from pipeinfer_cli.planner.profile import Profile

    cache = _node_local_cache(tmp_path, 2, smollm2_path)
    env_extra = {"PIPEINFER_CACHE": str(cache), "PIPEINFER_EMU_NODE_LOCAL": str(cache)}
    out = tmp_path / "profile.json"
    args = [sys.executable, "-m", "pipeinfer_cli", "calibrate", "smollm2-135m-instruct", "--ranks", 2, "--quick",
            "--threads", 1, "--ctx", 256, "--no-pull", "--out", out]
    for round_ in ("streamed", "cached"):
        marker = uuid.uuid4().hex
        try:
            r = subprocess.run(cluster2.cmd("exec", "--", *map(str, args)), capture_output=True, text=True,
                               timeout=600, env=job_env(marker, **env_extra))
        finally:
            assert_no_survivors(marker)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr
        sent = f"rank 1 (host {cluster2.host(1)}) has no copy of smollm2-135m-instruct: sending it the whole model file"
        assert (sent in r.stderr) == (round_ == "streamed"), r.stderr
        profile = Profile.load(out)
        assert [(rc.rank, rc.host) for rc in profile.ranks] == [(0, cluster2.host(0)), (1, cluster2.host(1))]
        assert all(rc.decode.s[0][0] > 0 and rc.spread is not None and rc.ranks_per_host == 1 for rc in profile.ranks)
        assert profile.model.sha256 == model_sha256(smollm2_path)
    slices = sorted(p.name.split(".", 1)[1] for p in Path(f"{cache}.{_host_of(1, 2)}/slices").glob("*.gguf"))
    assert slices == ["whole.gguf"]  # the probe's slice would be every layer: no smaller than the file


def test_a_stop_during_the_implicit_calibration_leaves_nothing_on_any_host(smollm2_path, cluster2, tmp_path):
    """`generate --ranks 2 --layer-split auto` without a profile calibrates first; SIGTERM to the
    command (through `exec`, which passes it on) during the calibration: the command ends with one
    line once no process of the calibration's job is left on either host and their MPI shared
    memory is gone. Before, the calibration ran on with its ranks after the command had died."""
    marker = uuid.uuid4().hex
    args = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--ranks", 2, "--layer-split",
            "auto", "--threads", 1, "-p", PROMPT, "-n", 4]
    p = subprocess.Popen(cluster2.cmd("exec", "--", *map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=job_env(marker, PIPEINFER_CACHE=str(tmp_path / "cache")), start_new_session=True)
    shm: set[Path] = set()
    try:
        deadline = time.monotonic() + 120
        while not any(b"calibrate" in Path(f"/proc/{q}/cmdline").read_bytes() for q in _ranks_in(cluster2)):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        time.sleep(2)  # MPI started on both hosts
        for q in cluster2.pids():
            try:
                shm |= {Path(line.split(None, 5)[5].strip()) for line in Path(f"/proc/{q}/maps").read_text().splitlines()
                        if "/dev/shm/mpich_" in line}
            except OSError:
                continue
        os.kill(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
        left = cluster2.pids()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        assert_no_survivors(marker)
    _, err = p.communicate(timeout=30)
    assert left == []
    assert shm and [f for f in shm if f.exists()] == []
    assert p.returncode == 128 + signal.SIGTERM
    assert err.decode().splitlines().count("Error: stopped by SIGTERM") == 1, err.decode()


def _ranks_in(emu) -> list[int]:
    out = []
    for q in emu.pids():
        try:
            if b"PMI_RANK=" in Path(f"/proc/{q}/environ").read_bytes():
                out.append(q)
        except OSError:
            continue
    return out


# -- the bytes cross the shaped link --------------------------------------------------------------

SEND = """
import sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
n = int(sys.argv[1])
buf = bytearray(n)
comm.Barrier()
if comm.rank == 0:
    t = time.perf_counter()
    comm.Send([buf, MPI.BYTE], dest=1)
    comm.Recv([buf, 1, MPI.BYTE], source=1)
    print(time.perf_counter() - t)
elif comm.rank == 1:
    comm.Recv([buf, MPI.BYTE], source=0)
    comm.Send([buf, 1, MPI.BYTE], dest=0)
"""


def test_a_large_send_takes_the_shaped_links_time(cluster2, tmp_path):
    """8 MiB at 10 Mbit/s is 6.7 s. Without UCX_TLS=tcp UCX would use shared memory across the
    namespaces, and the same send takes milliseconds."""
    emu, size = cluster2, 8 << 20
    script = tmp_path / "send.py"
    script.write_text(SEND)
    assert subprocess.run(emu.cmd("rate", "10mbit"), capture_output=True, timeout=30).returncode == 0
    try:
        before = emu.counters()
        r = subprocess.run(emu.cmd("mpiexec", "--", sys.executable, script, size), capture_output=True,
                           text=True, timeout=60)
        after = emu.counters()
    finally:
        assert subprocess.run(emu.cmd("rate", "100mbit"), capture_output=True, timeout=30).returncode == 0
    assert r.returncode == 0, r.stderr
    seconds = float(r.stdout.split()[0])
    mbit_s = size * 8 / seconds / 1e6
    print(f"8 MiB from {emu.host(0)} to {emu.host(1)} at 10mbit: {seconds:.2f} s, {mbit_s:.2f} Mbit/s")
    assert 5.0 < seconds < 30, mbit_s
    assert after[0][0] - before[0][0] >= size  # sent by host 0
    assert after[1][1] - before[1][1] >= size  # received by host 1


# -- faults ---------------------------------------------------------------------------------------

LONG = ["-p", "The quick brown fox", "-n", 3000, "--ctx", 4096, "--threads", 1]


def test_a_rank_killed_on_another_host_ends_the_job(cluster2, tiny_long):
    emu = cluster2
    proc, marker = start_job(emu.cmd("exec", "--", sys.executable, "-m", "pipeinfer_cli", "generate", tiny_long,
                                  *LONG, "--ranks", 2))
    wait_first_output(proc)
    ranks = [p for p in emu.pids() if b"PMI_RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()
             and b"pipeinfer_cli" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 1, ranks  # rank 1 runs in the namespace of host 1
    os.kill(ranks[0], signal.SIGKILL)
    rc, _, err = finish_job(proc, marker, within_s=10)
    lines = err.strip().splitlines()
    assert rc != 0
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1 and "abnormally" in errors[0], lines
    assert not [line for line in lines if "Traceback" in line], lines
    assert emu.pids() == []
    assert lines == errors, "only the error line: the launcher's teardown messages are left out"


def test_a_failing_rank_under_mpiexec_ends_the_job(smollm2_path, cluster3):
    """The plain Hydra form (world size from mpiexec -n, no --ranks): rank 2 on host 2 raises."""
    emu = cluster3
    proc, marker = start_job(emu.cmd("mpiexec", "--", sys.executable, "-m", "pipeinfer_cli", "generate", smollm2_path,
                                  "-p", PROMPT, "-n", 64, "--threads", 1, "--mode", "pipeinfer", "--draft", "lookup"),
                          PIPEINFER_DEBUG_FAIL="2:3")
    rc, _, err = finish_job(proc, marker, within_s=60)
    lines = err.strip().splitlines()
    assert rc != 0
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith("Error: rank 2: ") and "injected fault" in errors[0], lines
    assert not [line for line in lines if "Traceback" in line or "BAD TERMINATION" in line], lines
    assert emu.pids() == []


# -- run: up, one job, down -----------------------------------------------------------------------

def test_run_brings_up_runs_and_removes_everything(smollm2_path):
    prefix, subnet = f"pt{_ID}c", free_subnet()
    emu = Emu(2, prefix, subnet)
    marker = uuid.uuid4().hex
    args = [smollm2_path, *COMMON, "--mode", "iterative"]
    try:
        r = subprocess.run(emu.cmd("run", 2, "--rate", "1gbit", "--", *args), capture_output=True, text=True,
                           timeout=120, env=job_env(marker))
    finally:
        assert_no_survivors(marker)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    key = (2, "iterative", "greedy")
    if key not in _shm:
        _shm[key], _ = generate(smollm2_path, 2, "iterative", "greedy")
    assert got["tokens"] == _shm[key]["tokens"]
    assert leftovers(prefix) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_run_removes_everything(tiny_long, sig):
    prefix, subnet = f"pt{_ID}c", free_subnet()
    emu = Emu(2, prefix, subnet)
    proc, marker = start_job(emu.cmd("run", 2, "--", tiny_long, *LONG))
    wait_first_output(proc)
    assert leftovers(prefix) != []  # it is up
    proc.send_signal(sig)
    rc, _, err = finish_job(proc, marker, within_s=15)
    lines = err.strip().splitlines()
    assert rc == 128 + sig
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert leftovers(prefix) == []


# -- hosts with their own CPU and memory (--cpus, --mem) -------------------------------------------

def _cgroups_unusable() -> str | None:
    from cluster.cgroups import CgroupError, Cgroups

    try:
        Cgroups("probe")
    except CgroupError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def capped2():
    """2 hosts of half a core each (a CFS quota of 5 ms every 10 ms), 1 GiB of memory each."""
    if (why := _cgroups_unusable()) is not None:
        pytest.skip(why)
    emu = Emu(2, f"pt{_ID}c", free_subnet())
    subprocess.run(emu.cmd("down"), capture_output=True, timeout=60)
    r = subprocess.run(emu.cmd("up", 2, "--rate", "1gbit", "--cpus", "0.5", "--mem", "1g"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "0.5 CPU, 1 GiB" in r.stdout
    try:
        yield emu
    finally:
        r = subprocess.run(emu.cmd("down"), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert leftovers(emu.prefix) == []
        assert not list(Path("/sys/fs/cgroup/cpu").glob(f"**/{emu.prefix}")), "a cgroup was left"


def _usage(emu: Emu) -> dict:
    r = subprocess.run(emu.cmd("status", "--json"), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])["usage"]


BUSY = "import threading, time\ndef spin():\n    t = time.monotonic()\n    while time.monotonic() - t < 1.5: pass\n" \
       "ts = [threading.Thread(target=spin) for _ in range(2)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n" \
       "import os; print(os.sched_getaffinity(0).__len__())"


def test_a_capped_host_gets_no_cpu_beyond_its_quota(capped2):
    """Two busy threads on a host capped at half a core: its cgroup counts at most half a core of
    CPU time over the wall time (plus one period), though the machine has 2 cores free to them."""
    emu = capped2
    before = _usage(emu)[emu.host(1)]
    t0 = time.monotonic()
    r = subprocess.run(emu.cmd("on", 1, "--", sys.executable, "-c", BUSY), capture_output=True, text=True, timeout=60)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    after = _usage(emu)[emu.host(1)]
    used = after["cpu_s"] - before["cpu_s"]
    assert 0.05 < used <= 0.5 * wall + 0.05, (used, wall)  # the kernel enforces it, whatever else runs
    assert after["cpus"] == 0.5 and after["n_throttled"] >= before["n_throttled"]
    assert _usage(emu)[emu.host(0)]["cpu_s"] < 0.5, "host 0 ran nothing of it"


def test_a_capped_job_follows_its_share_and_gives_the_tokens_of_shared_memory(smollm2_path, capped2):
    """pipeinfer on 2 hosts of half a core, threads chosen by the ranks (no --threads): each rank
    runs 1 thread, every host's cgroup counted its rank's CPU, and the tokens equal the same job's
    over shared memory."""
    emu = capped2
    args = [sys.executable, "-m", "pipeinfer_cli", "generate", smollm2_path, "-p", PROMPT, "-n", 16, "--ctx", 256,
            "--json", "--ranks", 2, "--mode", "pipeinfer", "--draft", "lookup"]
    args = list(map(str, args))
    before = _usage(emu)
    marker = uuid.uuid4().hex
    try:
        r = subprocess.run(emu.cmd("exec", "--", *args), capture_output=True, text=True, timeout=300, env=job_env(marker))
    finally:
        assert_no_survivors(marker)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    after = _usage(emu)
    assert [rk["threads"] for rk in got["ranks"]] == [1, 1], got["ranks"]
    for k in range(2):
        assert after[emu.host(k)]["cpu_s"] - before[emu.host(k)]["cpu_s"] > 0.1, (k, before, after)
    shm = subprocess.run(args + ["--threads", "1"], capture_output=True, text=True, timeout=300)
    assert shm.returncode == 0, shm.stderr
    assert got["tokens"] == json.loads(shm.stdout)["tokens"]


def test_a_rank_over_its_host_memory_refuses_in_one_line(smollm2_path, capped2):
    """--ctx 131072 needs about 1.5 GiB of KV cache on each of SmolLM2's 2 ranks, on hosts of 1 GiB:
    the ranks refuse before loading, with one Error line that names a host and its limit, and
    nothing hangs."""
    emu = capped2
    args = [sys.executable, "-m", "pipeinfer_cli", "generate", smollm2_path, "-p", PROMPT, "-n", 4,
            "--ctx", 131072, "--ranks", 2]
    marker = uuid.uuid4().hex
    try:
        r = subprocess.run(emu.cmd("exec", "--", *map(str, args)), capture_output=True, text=True, timeout=120,
                           env=job_env(marker))
    finally:
        assert_no_survivors(marker)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert r.returncode != 0
    assert len(errors) == 1, r.stderr
    assert "memory limit is 1.1 GB (cgroup)" in errors[0] and f"(host {emu.prefix}-h" in errors[0], errors
    assert "Traceback" not in r.stderr

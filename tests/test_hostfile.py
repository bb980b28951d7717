"""`--ranks N` with a Hydra hostfile (HYDRA_HOST_FILE): which host each rank lands on, and the one
line that says so when a host gets more ranks than the hostfile gave it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobprocs import job_env
from pipeinfer_cli.transport.hostfile import placement, read_hostfile, shared_hosts_line


def test_hydra_fills_each_hosts_slots_in_order_then_starts_again(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the cluster\nnode01:2\nnode02  # one slot\n\nnode03:1\n")
    hosts = read_hostfile(f)
    assert hosts == [("node01", 2), ("node02", 1), ("node03", 1)]
    assert placement(hosts, 6) == ["node01", "node01", "node02", "node03", "node01", "node01"]


@pytest.mark.parametrize("text", ["node01 slots=2\n", "node01:x\n", "node01:0\n", "\n# nothing\n"])
def test_a_hostfile_of_another_form_is_left_alone(tmp_path, text):
    f = tmp_path / "hosts"
    f.write_text(text)
    assert read_hostfile(f) is None
    assert read_hostfile(tmp_path / "missing") is None


def test_five_ranks_on_four_hosts_name_the_host_that_gets_two():
    hosts = [(f"h{k}", 1) for k in range(4)]
    line = shared_hosts_line(hosts, 5, "hosts")
    assert line == ("pipeinfer: warning: 5 ranks on the 4 slots of the hostfile hosts (HYDRA_HOST_FILE): ranks share "
                    "a host's CPU and memory on h0 (2 ranks); pass --ranks 4, or give that host as many slots (h0:2) "
                    "to mean it")
    assert shared_hosts_line(hosts, 4, "hosts") is None


def test_slots_the_hostfile_gives_are_asked_for():
    assert shared_hosts_line([("h0", 2), ("h1", 1)], 3, "hosts") is None  # h0:2 says two ranks there
    assert "h0 (3 ranks)" in shared_hosts_line([("h0", 2), ("h1", 1)], 4, "hosts")


@pytest.mark.mpi
def test_a_job_on_more_ranks_than_slots_says_so_once(smollm2_path, tmp_path):
    f = tmp_path / "hosts"
    f.write_text("localhost:2\n")  # Hydra runs ranks on localhost without ssh
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--ranks", "3",
                        "--threads", "1", "-p", "Hi", "-n", "2"], capture_output=True, text=True,
                       env=job_env("hostfile", HYDRA_HOST_FILE=str(f)), timeout=300)
    assert r.returncode == 0, r.stderr
    warnings = [l for l in r.stderr.splitlines() if "slots of the hostfile" in l]
    assert warnings == [f"pipeinfer: warning: 3 ranks on the 2 slots of the hostfile {f} (HYDRA_HOST_FILE): ranks "
                        "share a host's CPU and memory on localhost (3 ranks); pass --ranks 2, or give that host as "
                        "many slots (localhost:3) to mean it"]

"""Which hosts of a hostfile still answer: for each, a one-process job started there through the
same launcher as the real job (the bundled Hydra: its proxy on the host must reach the launching
machine back over the network), within a deadline. A host that is down, cut off or whose launcher
hangs does not answer. The probes run side by side."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading

from .launch import find_mpiexec

PROBE_TIMEOUT_S = 10.0
HOSTFILE_ENV = "HYDRA_HOST_FILE"


def hostfile_hosts(environ=os.environ) -> list[str] | None:
    """The hosts of the bundled Hydra's hostfile (HYDRA_HOST_FILE), in order, one entry per line
    ("host" or "host:slots"); None without one."""
    path = environ.get(HOSTFILE_ENV)
    if not path:
        return None
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError:
        return None
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def host_name(entry: str) -> str:
    return entry.split(":")[0].strip()


def answering(entries: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The hostfile entries whose host answers, in their order."""
    ok: dict[str, bool] = {}

    def probe(entry: str) -> None:
        with tempfile.NamedTemporaryFile("w", prefix="pipeinfer-probe-", suffix=".hosts", delete=False) as f:
            f.write(host_name(entry) + "\n")
        env = {**os.environ, HOSTFILE_ENV: f.name}
        try:
            r = subprocess.run([find_mpiexec(), "-n", "1", "true"], env=env, capture_output=True,
                               timeout=timeout_s, start_new_session=True)
            ok[entry] = r.returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            ok[entry] = False
        finally:
            os.unlink(f.name)

    threads = [threading.Thread(target=probe, args=(e,), daemon=True) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return [e for e in entries if ok.get(e)]


def ranks_on(entries: list[str], n_ranks: int) -> list[str]:
    """The host of each rank, as Hydra places n_ranks on the hostfile's entries: each entry's slots
    (1 unless "host:N") in order, round again from the first when they are all used."""
    slots = []
    for e in entries:
        name, _, n = e.partition(":")
        slots += [name.strip()] * (int(n) if n.strip().isdigit() and int(n) > 0 else 1)
    return [slots[i % len(slots)] for i in range(n_ranks)] if slots else []

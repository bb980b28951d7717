"""`pipeinfer calibrate` where only the head has the model (runtime/calibrate_weights.py):

- a cached slice that holds the probe's layers is used (the probe's own slice, or a job's stage);
- a real 2-rank job whose rank 1 has an empty cache (MPMD, one PIPEINFER_CACHE per rank): the head
  sends rank 1 the probe's slice, or the whole file, and says so; the profile has both ranks' rows, the model's
  identity and the machine's as a normal calibration records them, and `plan --profile` and
  `--layer-split auto --profile` take it (and repeat the calibration's warnings); the next
  calibration reads rank 1's node cache;
- a draft rank without the models is sent the probe's slice and the whole draft file, and times it.

The emulated cluster's version (2 hosts, host 1 without the model) is in test_emulated_cluster.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from node_cache import cache_with

from jobprocs import finish_job, start_job
from pipeinfer_cli.planner.identity import model_sha256
from pipeinfer_cli.planner.profile import Profile
from pipeinfer_cli.runtime.host_facts import host_facts
from pipeinfer_cli.runtime.calibrate_weights import covering_slice, probe_parts

BIN = Path(sys.executable).parent
MPIEXEC, PIPEINFER = str(BIN / "mpiexec"), str(BIN / "pipeinfer")
MODEL = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _store(model_sha: str, layers: tuple[int, int], data: bytes) -> Path:
    from pipeinfer_cli.models.slice_cache import SliceWriter

    with SliceWriter("m", model_sha, layers, len(data)) as w:
        w.write(data)
        return w.commit(hashlib.sha256(data).hexdigest())


def test_the_probe_is_one_range_ending_at_the_last_layer():
    assert probe_parts([2 << 20] * 30) == [(0, 30)]
    assert probe_parts([900 << 20] * 4) == [(2, 4)]
    assert probe_parts([40 << 20] * 28, 128 << 20) == [(24, 28)]


def test_a_cached_slice_that_holds_the_probe_layers_is_used(cache):
    sha = "cd" * 32
    assert covering_slice(sha, (0, 5)) is None and covering_slice(None, (0, 5)) is None
    first = _store(sha, (0, 15), b"first stage")
    last = _store(sha, (15, 30), b"last stage")
    _store("ef" * 32, (0, 30), b"another model")
    assert covering_slice(sha, (0, 5)) == first
    assert covering_slice(sha, (29, 30)) == last
    assert covering_slice(sha, (10, 20)) is None  # no one slice holds it
    own = _store(sha, (0, 5), b"the probe's own")
    assert covering_slice(sha, (0, 5)) == own
    raw = bytearray(first.read_bytes())  # a damaged slice is not used (and removed)
    raw[0] ^= 1
    first.write_bytes(bytes(raw))
    assert covering_slice(sha, (0, 12)) is None and not first.exists()


def _mpmd(caches: list[Path], args: list) -> tuple[int, str, str]:
    cmd = [MPIEXEC]
    for k, c in enumerate(caches):
        cmd += ([":"] if k else []) + ["-n", 1, "-env", "PIPEINFER_CACHE", str(c), PIPEINFER, *args]
    proc, marker = start_job(cmd)
    return finish_job(proc, marker, within_s=300)


@pytest.mark.mpi
def test_calibrate_with_the_model_on_the_head_alone(smollm2_path, tmp_path):
    head, empty = cache_with(tmp_path, "head", smollm2_path), tmp_path / "empty"
    out = tmp_path / "p.json"
    args = ["calibrate", MODEL, "--quick", "--threads", 1, "--no-pull", "--out", out]
    rc, _, err = _mpmd([head, empty], args)
    assert rc == 0, err
    # SmolLM2's probe (layers 0-28 and 29) is every layer: it is sent the file
    assert f"has no copy of {MODEL}: sending it the whole model file" in err and "sending it layers" not in err
    assert "calibrate: rank 1: layers 0-28" in err and "Traceback" not in err
    profile = Profile.load(out)
    assert [r.rank for r in profile.ranks] == [0, 1]
    assert all(r.decode.s and r.prefill.s and r.spread is not None for r in profile.ranks)
    assert {(lk.src, lk.dst) for lk in profile.links} == {(0, 1), (1, 0)}
    # the identities a normal calibration records: the model's file, and each rank's machine
    assert profile.model.sha256 == model_sha256(smollm2_path)
    assert profile.model.file_bytes == smollm2_path.stat().st_size and profile.model.n_layer == 30
    facts = host_facts()
    for r in profile.ranks:
        assert (r.threads, r.ranks_per_host, r.cpu, r.cores) == (1, 2, facts.cpu, facts.cores)
    assert [p.name.split(".", 1)[1] for p in (empty / "slices").glob("*.gguf")] == ["whole.gguf"]
    # the planner takes it: a prediction, and the auto split
    env = {**os.environ, "PIPEINFER_CACHE": str(head)}
    plan = [PIPEINFER, "plan", MODEL, "--profile", str(out), "--threads", "1", "-p", "Hi", "-n", "4"]
    r = subprocess.run(list(map(str, plan)), capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "predicted:" in r.stdout, r.stderr
    raw = json.loads(out.read_text())  # a calibration that warned: plan repeats it
    raw["warnings"] = ["rank 1: figures stayed unreliable (test)"]
    out.write_text(json.dumps(raw))
    r = subprocess.run(list(map(str, [*plan, "--layer-split", "auto"])), capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "warning: the profile's calibration said: rank 1: figures stayed unreliable (test)" in r.stderr
    # the next calibration reads rank 1's node cache: nothing is sent
    rc, _, err = _mpmd([head, empty], args)
    assert rc == 0, err
    assert "has no copy" not in err and len(Profile.load(out).ranks) == 2


@pytest.mark.mpi
def test_a_draft_rank_without_the_models_is_sent_the_probe_and_the_draft(smollm2_path, tmp_path):
    head, empty = cache_with(tmp_path, "head", smollm2_path), tmp_path / "empty"
    out = tmp_path / "d.json"
    args = ["calibrate", MODEL, "--draft", MODEL, "--layer-split", "1/1", "--quick", "--threads", 1, "--ctx", 512,
            "--no-pull", "--out", out]
    rc, _, err = _mpmd([head, empty], args)
    assert rc == 0, err
    assert "sending it the whole draft file" in err and "Traceback" not in err
    profile = Profile.load(out)
    assert [r.rank for r in profile.ranks] == [0, 1]
    assert profile.draft.kind == "model" and profile.draft.rank == 1 and profile.draft.token_s > 0
    assert profile.draft.sha256 == model_sha256(smollm2_path)
    assert "whole.gguf" in {p.name.split(".", 1)[1] for p in (empty / "slices").glob("*.gguf")}


def test_a_probe_asks_for_its_slices_or_the_whole_file_whichever_is_smaller():
    """A small model's probe holds nearly every layer and each slice carries the embedding table:
    the whole file is less to send. A large model's probe is a fraction of it: its slices."""
    from types import SimpleNamespace

    from pipeinfer_cli.models.weight_copies import Need
    from pipeinfer_cli.runtime.calibrate_weights import probe_needs

    mb = 2**20
    small = SimpleNamespace(layer_bytes=[2 * mb] * 30, token_embd_bytes=28 * mb, output_bytes=28 * mb,
                            other_bytes=0, file_size=(60 + 28) * mb)
    assert probe_needs(small, [(0, 30)]) == [Need("target", None)]
    large = SimpleNamespace(layer_bytes=[40 * mb] * 28, token_embd_bytes=200 * mb, output_bytes=200 * mb,
                            other_bytes=0, file_size=(1120 + 200) * mb)
    assert probe_needs(large, [(15, 28)]) == [Need("target", (15, 28))]
    assert probe_needs(large, []) == []

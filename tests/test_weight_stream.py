"""Weights from the head (runtime/weight_stream.py, models/weight_copies.py, transport/weight_transfer.py,
models/weight_slices.py, models/slice_cache.py).

- Which tensors a stage's slice holds, for any layer count and split (a property).
- A slice is a GGUF the layer engine loads to exactly the whole file's hidden states and logits.
- The node cache: a complete file is found again, a flipped byte is caught (and the file removed),
  a damaged or interrupted stream leaves no file, files follow the umask, `models` lists and prunes.
- Real MPI jobs whose rank 1 has an empty cache (MPMD, one PIPEINFER_CACHE per rank): the tokens
  are those of a 1-rank job in every mode; the next job reads the node cache (0 bytes received);
  a draft rank is sent the whole draft file; a corrupt slice is sent again; a rank stopped in the
  middle of its stream ends the job with one line and leaves no partial file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from node_cache import cache_with
from hypothesis import given, settings
from hypothesis import strategies as st

from jobprocs import finish_job, marked_pids, start_job

from pipeinfer_cli.models.weight_slices import stage_slice, stage_tensor_names, iter_chunks
from pipeinfer_cli.wording import human_bytes

BIN = Path(sys.executable).parent
MPIEXEC, PIPEINFER = str(BIN / "mpiexec"), str(BIN / "pipeinfer")
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


# -- which tensors ------------------------------------------------------------------------------

def _names(n_layer: int, tied: bool, rope_freqs: bool) -> list[str]:
    names = ["token_embd.weight"] + (["rope_freqs.weight"] if rope_freqs else [])
    for i in range(n_layer):
        names += [f"blk.{i}.attn_norm.weight", f"blk.{i}.attn_q.weight", f"blk.{i}.ffn_down.weight"]
    names += ["output_norm.weight"] + ([] if tied else ["output.weight"])
    return names


@settings(max_examples=300, deadline=None)
@given(n_layer=st.integers(1, 80), data=st.data(), tied=st.booleans(), rope_freqs=st.booleans())
def test_every_tensor_goes_to_the_stages_that_need_it(n_layer, data, tied, rope_freqs):
    cuts = sorted(data.draw(st.sets(st.integers(1, n_layer - 1), max_size=min(8, n_layer - 1)))) if n_layer > 1 else []
    bounds = [0, *cuts, n_layer]
    names = _names(n_layer, tied, rope_freqs)
    stages = [stage_tensor_names(names, n_layer, b, e) for b, e in zip(bounds, bounds[1:])]
    for (b, e), got in zip(zip(bounds, bounds[1:]), stages):
        assert got == [n for n in names if n in got]  # file order kept
        layers = {int(n.split(".")[1]) for n in got if n.startswith("blk.")}
        assert layers == set(range(b, e))
        assert ("token_embd.weight" in got) == (b == 0 or (e == n_layer and tied))
        assert ("output_norm.weight" in got) == (e == n_layer)
        assert ("output.weight" in got) == (e == n_layer and not tied)
        assert ("rope_freqs.weight" in got) == rope_freqs
    for n in names:
        if n.startswith("blk."):
            assert sum(n in s for s in stages) == 1


# -- slices compute what the whole file computes ------------------------------------------------

def _write(src, path: Path) -> Path:
    with open(path, "wb") as f:
        for chunk in iter_chunks(src, 1 << 20):
            f.write(chunk)
    assert path.stat().st_size == src.total
    return path


@pytest.mark.parametrize("fixture", ["smollm2_path", "gemma3_path"])
def test_a_split_into_slices_computes_exactly_the_whole_model(request, fixture, tmp_path):
    from pipeinfer_cli import _native
    from pipeinfer_cli.native import LayerEngine

    model = request.getfixturevalue(fixture)
    kv = _native.gguf_metadata(str(model))["kv"]
    n = kv[f"{kv['general.architecture']}.block_count"]
    mid = n // 2
    first = _write(stage_slice(model, "0" * 64, 0, mid), tmp_path / "a.gguf")
    last = _write(stage_slice(model, "0" * 64, mid, n), tmp_path / "b.gguf")
    assert max(first.stat().st_size, last.stat().st_size) < model.stat().st_size
    tokens, pos, seq = np.array([1, 2, 3, 4, 5], np.int32), np.arange(5, dtype=np.int32), [[0]] * 5

    def run(p0: Path, p1: Path):
        a = LayerEngine(str(p0), 0, mid, n_ctx=64, n_threads=1)
        b = LayerEngine(str(p1), mid, n, n_ctx=64, n_threads=1)
        h = a.eval(tokens, pos=pos, seq_ids=seq)
        return h, b.eval(embd=h, pos=pos, seq_ids=seq, output=[True] * 5)

    (h_whole, l_whole), (h_slices, l_slices) = run(model, model), run(first, last)
    assert np.array_equal(h_whole, h_slices) and np.array_equal(l_whole, l_slices)
    meta = _native.gguf_metadata(str(last))
    assert meta["kv"]["pipeinfer.slice.layer_begin"] == mid and meta["kv"]["pipeinfer.slice.layer_end"] == n
    assert not any(t[0].startswith(f"blk.{mid - 1}.") for t in meta["tensors"])


# -- the node cache ------------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _store(data: bytes, layers=(3, 7), sha=None):
    import hashlib

    from pipeinfer_cli.models.slice_cache import SliceWriter

    with SliceWriter("m", "ab" * 32, layers, len(data)) as w:
        w.write(data[: len(data) // 2])
        w.write(data[len(data) // 2:])
        return w.commit(sha or hashlib.sha256(data).hexdigest())


def test_a_ranks_own_registry_copy_is_used_only_when_its_bytes_hash_to_the_heads(cache, tmp_path):
    """A registry model's digest is known without hashing, but another rank's copy of it may have
    been damaged since its pull: it is hashed (once) before it is trusted, and a damaged one is
    not used (the rank is then sent its weights)."""
    import hashlib

    from pipeinfer_cli.models.model_identity import identify
    from pipeinfer_cli.models.weight_copies import pick_copy

    data = bytes(range(256)) * 64
    digest = hashlib.sha256(data).hexdigest()
    head_file, good, bad = tmp_path / "head.gguf", tmp_path / "good.gguf", tmp_path / "bad.gguf"
    head_file.write_bytes(data)
    good.write_bytes(data)
    bad.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # the same size, one bit flipped
    head = identify(head_file, digest, len(data))
    path, source = pick_copy(identify(good, digest, len(data)), head, digest, (0, 4), "rank 1 (host h)")
    assert path == good.resolve() and source.source == "local"
    assert pick_copy(identify(bad, digest, len(data)), head, digest, (0, 4), "rank 1 (host h)") == (None, None)


def test_a_whole_cached_copy_serves_any_stage(cache, tmp_path):
    """A calibration may have been sent the whole model file: a job's stage on that node reads it
    instead of asking for its slice; its own slice, when cached, comes first."""
    from pipeinfer_cli.models.model_identity import identify
    from pipeinfer_cli.models.weight_copies import pick_copy

    whole = _store(b"w" * 3000, layers=None)
    head_file = tmp_path / "head.gguf"
    head_file.write_bytes(b"w" * 3000)
    head = identify(head_file)
    path, source = pick_copy(None, head, "ab" * 32, (3, 7), "rank 1 (host h)")
    assert path == whole and source.source == "cache"
    own = _store(b"s" * 1000, layers=(3, 7))
    assert pick_copy(None, head, "ab" * 32, (3, 7), "rank 1 (host h)")[0] == own
    assert pick_copy(None, head, "cd" * 32, (3, 7), "rank 1 (host h)") == (None, None)  # another model's


def test_a_cached_slice_that_includes_a_stages_layers_serves_it(cache, tmp_path):
    """Slices of other boundaries (a calibration's probe, an earlier job's split): the smallest
    one whose layers include the stage's is read, none that lacks one of them."""
    from pipeinfer_cli.models.model_identity import identify
    from pipeinfer_cli.models.weight_copies import pick_copy

    head_file = tmp_path / "head.gguf"
    head_file.write_bytes(b"w" * 3000)
    head = identify(head_file)
    _store(b"a" * 900, layers=(0, 6))
    wide = _store(b"b" * 2000, layers=(0, 16))
    narrow = _store(b"c" * 1000, layers=(5, 15))
    assert pick_copy(None, head, "ab" * 32, (7, 14), "rank 1 (host h)")[0] == narrow
    assert pick_copy(None, head, "ab" * 32, (0, 14), "rank 1 (host h)")[0] == wide
    assert pick_copy(None, head, "ab" * 32, (14, 20), "rank 1 (host h)") == (None, None)


def test_a_stage_computes_the_same_from_a_wider_slice(smollm2_path, tmp_path):
    from pipeinfer_cli import _native
    from pipeinfer_cli.native import LayerEngine

    n = _native.gguf_metadata(str(smollm2_path))["kv"]["llama.block_count"]
    wide = _write(stage_slice(smollm2_path, "0" * 64, 0, n - 4), tmp_path / "wide.gguf")
    tail = _write(stage_slice(smollm2_path, "0" * 64, 5, n), tmp_path / "tail.gguf")
    h = np.random.default_rng(0).standard_normal((5, 576)).astype(np.float32)
    pos, seq = np.arange(5, dtype=np.int32), [[0]] * 5

    def middle(path: Path):
        return LayerEngine(str(path), 7, 14, n_ctx=64, n_threads=1).eval(embd=h, pos=pos, seq_ids=seq)

    def last(path: Path):
        return LayerEngine(str(path), n - 3, n, n_ctx=64, n_threads=1).eval(embd=h, pos=pos, seq_ids=seq,
                                                                             output=[True] * 5)

    assert np.array_equal(middle(smollm2_path), middle(wide))
    assert np.array_equal(last(smollm2_path), last(tail))


def test_a_node_cache_that_cannot_take_slices_is_one_clear_error(cache):
    """The cache root writable but its slices/ not (here: a file in its place): one error naming
    the node cache and the fix, not an internal error; a bad slice that cannot be removed is said."""
    from pipeinfer_cli.errors import CacheError
    from pipeinfer_cli.models import slice_cache

    cache.mkdir(parents=True)
    (cache / "slices").write_text("not a directory")
    with pytest.raises(CacheError, match=r"cannot write the weights this rank is sent into the node cache .*slices: "
                                         r".*; fix its permissions or set PIPEINFER_CACHE"):
        slice_cache.SliceWriter("m", "ab" * 32, (3, 7), 10)
    (cache / "slices").unlink()
    path = _store(b"y" * 1000)
    side = path.with_suffix(".json")
    side.unlink()
    (side / "stuck").mkdir(parents=True)  # a record that cannot be removed
    found, why = slice_cache.lookup("ab" * 32, (3, 7))
    assert found is None and "its record is missing or unreadable (and it could not be removed: " in why, why


def test_a_cached_slice_is_found_and_a_flipped_byte_is_caught(cache):
    from pipeinfer_cli.models import slice_cache

    data = os.urandom(100_000)
    path = _store(data)
    assert path.read_bytes() == data and path.name == f"{'ab' * 32}.layers-3-6.gguf"
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert slice_cache.lookup("ab" * 32, (3, 7)) == (path, None)
    assert slice_cache.lookup("ab" * 32, (3, 8)) == (None, None)
    raw = bytearray(data)
    raw[54_321] ^= 1
    path.write_bytes(bytes(raw))
    found, why = slice_cache.lookup("ab" * 32, (3, 7))
    assert found is None and "corrupted" in why and not path.exists()
    assert slice_cache.list_cached() == [] and slice_cache.leftovers() == []


def test_a_truncated_cached_slice_is_caught_by_its_size_and_fetched_again(cache):
    from pipeinfer_cli.models import slice_cache

    data = os.urandom(50_000)
    path = _store(data)
    with open(path, "r+b") as f:  # a disk that filled up, a copy cut short
        f.truncate(30_000)
    found, why = slice_cache.lookup("ab" * 32, (3, 7))
    assert found is None and why is not None
    assert "it has 30000 bytes, its record says 50000" in why and "fetched again" in why, why
    assert not path.exists() and not path.with_suffix(".json").exists()
    assert slice_cache.lookup("ab" * 32, (3, 7)) == (None, None)


def test_partial_files_of_cut_streams_are_removed_at_start_and_said(cache, capsys):
    """A rank killed (SIGKILL) while it was sent its weights leaves its partial file; the next job
    that starts a rank on that host removes it, in one line on stderr, even when that rank needs
    no stream (it reads the model locally)."""
    from pipeinfer_cli.models.weight_copies import remove_cut_streams

    (cache / "slices").mkdir(parents=True)
    dead = cache / "slices" / f".{'ab' * 32}.layers-15-29.gguf~{socket.gethostname()}~999999999.partial"
    alive = cache / "slices" / f".y.gguf~{socket.gethostname()}~{os.getpid()}.partial"
    dead.write_bytes(b"x" * 2_500_000)
    alive.write_bytes(b"part")
    remove_cut_streams("rank 1 (host h)")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"pipeinfer: rank 1 (host h): removed the partial file {dead.name} (2.5 MB) that a cut stream "
                   f"of weights left in the node cache {cache / 'slices'}"], err
    assert not dead.exists() and alive.exists()  # a running writer's file stays
    remove_cut_streams("rank 1 (host h)")
    assert capsys.readouterr().err == ""  # nothing left to say


def test_prune_unused_days_honours_the_age_of_partial_files(cache):
    (cache / "slices").mkdir(parents=True)
    host = socket.gethostname()
    young = cache / "slices" / f".a.gguf~{host}~999999998.partial"  # its writer ended two days ago
    old = cache / "slices" / f".b.gguf~{host}~999999999.partial"
    for p, days in ((young, 2), (old, 40)):
        p.write_bytes(b"part")
        t = time.time() - days * 86400
        os.utime(p, (t, t))
    env = {**os.environ, "PIPEINFER_CACHE": str(cache)}
    r = subprocess.run([PIPEINFER, "models", "prune", "--unused-days", "30"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "1 leftover file" in r.stderr, r.stderr
    assert young.exists() and not old.exists()
    r = subprocess.run([PIPEINFER, "models", "prune"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "1 leftover file" in r.stderr and not young.exists(), r.stderr


def test_a_damaged_or_interrupted_stream_leaves_no_file(cache):
    from pipeinfer_cli.models import slice_cache

    with pytest.raises(OSError, match="arrived damaged"):
        _store(b"x" * 1000, sha="0" * 64)
    with pytest.raises(RuntimeError):
        with slice_cache.SliceWriter("m", "cd" * 32, None, 10) as w:
            w.write(b"12345")
            raise RuntimeError("cut")
    assert list((cache / "slices").iterdir()) == []


def test_partial_files_of_ended_writers_are_removed(cache):
    from pipeinfer_cli.models import slice_cache

    (cache / "slices").mkdir(parents=True)
    dead = cache / "slices" / f".x.gguf~{socket.gethostname()}~999999999.partial"
    alive = cache / "slices" / f".y.gguf~{socket.gethostname()}~{os.getpid()}.partial"
    elsewhere = cache / "slices" / ".z.gguf~another-host~1.partial"
    for p in (dead, alive, elsewhere):
        p.write_bytes(b"part")
    _store(b"data")
    assert not dead.exists() and alive.exists() and elsewhere.exists()


def test_models_list_shows_slices_and_prune_removes_them(cache):
    _store(os.urandom(5000))
    env = {**os.environ, "PIPEINFER_CACHE": str(cache)}
    cut = cache / "slices" / f".x.gguf~{socket.gethostname()}~999999999.partial"
    cut.write_bytes(b"p" * 700)
    listed = json.loads(subprocess.run([PIPEINFER, "models", "list", "--json"], capture_output=True, text=True,
                                       env=env, check=True).stdout)
    assert [(s["part"], s["size"]) for s in listed["slices"]] == [("layers-3-6", 5000)]
    assert listed["partial_files"] == [{"path": str(cut), "size": 700, "modified": cut.stat().st_mtime,
                                        "writing": False}]
    assert listed["partial_bytes"] == 700
    assert listed["cache_bytes"] == 5700 + sum(m["size"] for m in listed["models"] if m["downloaded"])
    plain = subprocess.run([PIPEINFER, "models", "list"], capture_output=True, text=True, env=env, check=True).stdout
    # Piped: what docs/models.md says, and only that (no header, total or partial files).
    lines = plain.splitlines()
    assert lines[-1].startswith("m@layers-3-6\tslice\t5000\tyes\t")
    assert all(len(ln.split("\t")) in (4, 5, 6) for ln in lines) and ".partial" not in plain
    assert lines[0].split("\t")[0] in listed["models"][0]["name"]
    kept = subprocess.run([PIPEINFER, "models", "prune", "--unused-days", "1"], capture_output=True, text=True, env=env)
    assert kept.returncode == 0 and "0 slices" in kept.stderr
    gone = subprocess.run([PIPEINFER, "models", "prune"], capture_output=True, text=True, env=env)
    assert gone.returncode == 0 and "1 slice and 1 leftover file" in gone.stderr and "freed 5.7 kB" in gone.stderr
    assert list((cache / "slices").iterdir()) == []


def test_models_rm_removes_a_models_slices(cache):
    from pipeinfer_cli.models.registry import load_registry
    from pipeinfer_cli.models.slice_cache import SliceWriter, list_cached

    entry = load_registry().model(MODEL)
    import hashlib

    with SliceWriter(MODEL, entry.sha256, (0, 5), 3) as w:
        w.write(b"abc")
        w.commit(hashlib.sha256(b"abc").hexdigest())
    _store(b"other model")  # another model's slice stays
    env = {**os.environ, "PIPEINFER_CACHE": str(cache)}
    r = subprocess.run([PIPEINFER, "models", "rm", MODEL, "--slices-only"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"{MODEL}: removed 1 rank slice" in r.stderr, r.stderr
    assert [s.model for s in list_cached()] == ["m"]
    r = subprocess.run([PIPEINFER, "models", "rm", "no-such-model"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stderr.startswith("Error: unknown model 'no-such-model'")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- real jobs: rank 1 without the model ----------------------------------------------------------

def _mpmd(caches: list[Path], args: list, **env) -> tuple[int, str, str]:
    cmd = [MPIEXEC]
    for k, c in enumerate(caches):
        cmd += ([":"] if k else []) + ["-n", 1, "-env", "PIPEINFER_CACHE", str(c), PIPEINFER, *args]
    proc, marker = start_job(cmd, **env)
    return finish_job(proc, marker, within_s=120)


def _solo(model_cache: Path, args: list) -> dict:
    r = subprocess.run([PIPEINFER, *map(str, args), "--ranks", "1"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PIPEINFER_CACHE": str(model_cache)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


MODES = {"iterative": [], "speculative": ["--draft", "lookup"], "pipeinfer": ["--draft", MODEL],
         "pipeinfer-seeded": ["--draft", MODEL, "--temp", "0.8", "--seed", "7"]}


@pytest.mark.mpi
@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_layers_give_the_tokens_of_one_rank(smollm2_path, tmp_path, mode):
    head = cache_with(tmp_path, "head", smollm2_path)
    args = ["generate", MODEL, "-p", PROMPT, "-n", 24, "--threads", 1, "--json", "--no-pull",
            "-M", mode.split("-")[0], *MODES[mode]]
    solo = _solo(head, args)
    rc, out, err = _mpmd([head, tmp_path / "empty"], args)
    assert rc == 0, err
    got = json.loads(out)
    assert got["tokens"] == solo["tokens"] and got["text"] == solo["text"]
    weights = [r["weights"] for r in got["ranks"]]
    assert weights[0]["source"] == "local" and weights[0]["bytes_received"] == 0
    assert weights[1]["source"] == "stream" and weights[1]["bytes_received"] > 10_000_000
    assert f"rank 1 (host {socket.gethostname()}) has no copy of {MODEL}: sending it layers" in err
    assert "Traceback" not in err
    # The next job on that node reads the slice from its cache: nothing crosses the link.
    rc, out, err = _mpmd([head, tmp_path / "empty"], args)
    assert rc == 0, err
    again = json.loads(out)
    assert again["tokens"] == solo["tokens"]
    assert again["ranks"][1]["weights"]["source"] == "cache" and again["ranks"][1]["weights"]["bytes_received"] == 0
    assert "has no copy" not in err


@pytest.mark.mpi
def test_a_new_split_is_sent_only_the_layers_the_node_cache_lacks(smollm2_path, tmp_path):
    """Rank 1 holds layers 15-29 from a job split 1,1; a job split 1,2 needs 10-29: the head sends
    layers 10-14 (and the file's header), the rank copies the rest from its cached slice, and the
    new file replaces the slice it includes. The tokens are the 1-rank job's."""
    head, node = cache_with(tmp_path, "head", smollm2_path), tmp_path / "node"
    args = ["generate", MODEL, "-p", PROMPT, "-n", 12, "--threads", 1, "--json", "--no-pull"]
    solo = _solo(head, args)
    rc, out, err = _mpmd([head, node], [*args, "--layer-split", "1,1"])
    assert rc == 0, err
    first = json.loads(out)["ranks"][1]["weights"]
    rc, out, err = _mpmd([head, node], [*args, "--layer-split", "1,2"])
    assert rc == 0, err
    got = json.loads(out)
    assert got["tokens"] == solo["tokens"]
    second = got["ranks"][1]["weights"]
    assert second["source"] == "stream"
    assert 0 < second["bytes_received"] < first["bytes_received"] / 2, (first, second)
    assert "sending it layers 10-29" in err and "of it from its node cache" in err, err
    assert "(the new layers 10-29 holds their layers)" in err
    slices = sorted(p.name for p in (node / "slices").glob("*.gguf"))
    assert len(slices) == 1 and slices[0].endswith(".layers-10-29.gguf"), slices


@pytest.mark.mpi
def test_a_draft_rank_is_sent_the_whole_draft_and_a_corrupt_slice_is_sent_again(smollm2_path, tmp_path):
    head = cache_with(tmp_path, "head", smollm2_path)
    args = ["generate", MODEL, "-p", PROMPT, "-n", 24, "--threads", 1, "--json", "--no-pull",
            "-M", "pipeinfer", "--draft", MODEL, "--layer-split", "0.5,0.5/1"]
    solo = _solo(head, [a for a in args if a not in ("--layer-split", "0.5,0.5/1")])
    empty1, empty2 = tmp_path / "e1", tmp_path / "e2"
    rc, out, err = _mpmd([head, empty1, empty2], args)
    assert rc == 0, err
    got = json.loads(out)
    assert got["tokens"] == solo["tokens"]
    draft = got["ranks"][2]["weights"]
    assert draft["source"] == "stream" and draft["bytes_received"] == smollm2_path.stat().st_size
    assert (empty2 / "slices").is_dir() and [p.name.split(".", 1)[1] for p in (empty2 / "slices").glob("*.gguf")] == ["whole.gguf"]
    # A flipped byte in rank 1's slice: caught, said, and the slice is sent again.
    (sliced,) = (empty1 / "slices").glob("*.gguf")
    raw = bytearray(sliced.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    sliced.write_bytes(bytes(raw))
    rc, out, err = _mpmd([head, empty1, empty2], args)
    assert rc == 0, err
    again = json.loads(out)
    assert again["tokens"] == solo["tokens"]
    assert "was not used: its bytes no longer match their sha256 (corrupted); it is fetched again" in err
    assert again["ranks"][1]["weights"]["source"] == "stream" and again["ranks"][2]["weights"]["source"] == "cache"


def _signal_rank_1_mid_stream(smollm2_path, tmp_path, signum: int) -> tuple[list[Path], list, int, str, str]:
    """A 2-rank job whose rank 1 has an empty cache and is streamed its slice slowly (about 12 s);
    once its partial file exists, rank 1 gets `signum`. Returns ([head's cache, rank 1's cache], the
    job's arguments, rc, stdout, stderr)."""
    head, empty = cache_with(tmp_path, "head", smollm2_path), tmp_path / "empty"
    args = ["generate", MODEL, "-p", PROMPT, "-n", 8, "--threads", 1, "--no-pull"]
    cmd = [MPIEXEC, "-n", 1, "-env", "PIPEINFER_CACHE", str(head), PIPEINFER, *args, ":",
           "-n", 1, "-env", "PIPEINFER_CACHE", str(empty), PIPEINFER, *args]
    proc, marker = start_job(cmd, PIPEINFER_DEBUG_STREAM_RATE="4e6")
    deadline = time.monotonic() + 60
    while not list((empty / "slices").glob("*.partial")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    receivers = [p for p in marked_pids(marker) if b"PMI_RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()
                 and b"pipeinfer" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert receivers, "rank 1 is not running"
    for p in receivers:
        os.kill(p, signum)
    rc, out, err = finish_job(proc, marker, within_s=60)
    return [head, empty], args, rc, out, err


@pytest.mark.mpi
def test_a_rank_whose_node_cache_cannot_take_its_weights_fails_before_the_stream(smollm2_path, tmp_path):
    """Rank 1 lacks the model and its node cache has a file where slices/ goes: one error line
    naming the rank, the cache and the fix; the head never starts sending."""
    head, broken = cache_with(tmp_path, "head", smollm2_path), tmp_path / "broken"
    broken.mkdir()
    (broken / "slices").write_text("not a directory")
    rc, out, err = _mpmd([head, broken], ["generate", MODEL, "-p", PROMPT, "-n", 8, "--threads", 1, "--no-pull"])
    assert rc != 0 and out == ""
    errors = [ln for ln in err.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith("Error: rank 1 (host "), err
    assert f"cannot write the weights this rank is sent into the node cache {broken / 'slices'}" in errors[0], err
    assert "has no copy" not in err and "Traceback" not in err


@pytest.mark.mpi
def test_a_rank_stopped_mid_stream_ends_the_job_with_one_line_and_no_partial_file(smollm2_path, tmp_path):
    (_, empty), _, rc, out, err = _signal_rank_1_mid_stream(smollm2_path, tmp_path, 15)
    assert rc != 0 and out == ""
    errors = [ln for ln in err.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith("Error: rank 1 (host ") and "stopped by SIGTERM" in errors[0], err
    assert "Traceback" not in err
    assert list((empty / "slices").iterdir()) == []


@pytest.mark.mpi
def test_a_rank_killed_mid_stream_leaves_a_partial_file_that_the_next_job_removes(smollm2_path, tmp_path):
    # SIGKILL: the rank cannot remove its partial file
    (head, empty), args, rc, _, _ = _signal_rank_1_mid_stream(smollm2_path, tmp_path, 9)
    assert rc != 0
    (left,) = list((empty / "slices").glob("*.partial"))
    size = human_bytes(left.stat().st_size)
    # The next job: rank 1's host now has the model itself, so nothing is streamed; its start removes the file.
    cache_with(tmp_path, "empty", smollm2_path)
    rc, out, err = _mpmd([head, empty], args)
    assert rc == 0, err
    said = [ln for ln in err.splitlines() if "partial file" in ln]
    assert said == [f"pipeinfer: rank 1 (host {socket.gethostname()}): removed the partial file {left.name} "
                    f"({size}) that a cut stream of weights left in the node cache {empty / 'slices'}"], err
    assert not left.exists() and "has no copy" not in err


def test_prune_spares_a_file_a_running_job_writes_and_rm_takes_a_path(cache, tmp_path):
    from pipeinfer_cli.models.slice_cache import SliceWriter, list_cached

    env = {**os.environ, "PIPEINFER_CACHE": str(cache)}
    with SliceWriter("m", "ef" * 32, (0, 2), 4) as w:  # this process is alive: its partial file stays
        w.write(b"ab")
        w._f.flush()
        r = subprocess.run([PIPEINFER, "models", "prune"], capture_output=True, text=True, env=env)
        assert r.returncode == 0 and "0 leftover files" in r.stderr, r.stderr
        assert w.tmp.exists()
        listed = json.loads(subprocess.run([PIPEINFER, "models", "list", "--json"], capture_output=True, text=True,
                                           env=env, check=True).stdout)
        assert listed["partial_bytes"] == 2
        w.tmp.unlink()  # as a prune by hand would: the commit says so instead of failing obscurely
        w.write(b"cd")
        with pytest.raises(OSError, match="was removed while it was written"):
            w.commit(__import__("hashlib").sha256(b"abcd").hexdigest())
    model = tmp_path / "mine.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    from pipeinfer_cli.models.model_identity import file_sha256, identify

    with SliceWriter(str(model), file_sha256(identify(model)), (0, 3), 3) as w:
        w.write(b"xyz")
        w.commit(__import__("hashlib").sha256(b"xyz").hexdigest())
    r = subprocess.run([PIPEINFER, "models", "rm", str(model)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "removed 1 rank slice" in r.stderr, r.stderr
    assert list_cached() == [] and model.exists()


def test_the_wire_skips_exactly_the_pieces_the_rank_holds():
    from pipeinfer_cli.models.weight_slices import outside

    data = bytes(range(256)) * 40
    skipped = [(100, 50, "a"), (150, 10, "b"), (4000, 3000, "c"), (10000, 240, "d")]
    for step in (1, 7, 64, 999, len(data)):
        sent, at = bytearray(), 0
        for k in range(0, len(data), step):
            chunk = data[k:k + step]
            for part in outside(chunk, at, skipped):
                sent += part
            at += len(chunk)
        kept = bytearray()
        pos = 0
        for start, size, _ in skipped:
            kept += data[pos:start]
            pos = start + size
        kept += data[pos:]
        assert bytes(sent) == bytes(kept)


def test_the_node_cache_cap_removes_the_least_recently_used_files_first(cache, monkeypatch):
    from pipeinfer_cli.models import cache_budget, slice_cache

    old, mid, new = _store(b"o" * 1000, layers=(0, 4)), _store(b"m" * 1000, layers=(4, 8)), _store(b"n" * 1000, layers=(8, 12))
    for k, p in enumerate((old, mid, new)):  # last used long ago, in this order
        os.utime(p.with_suffix(".json"), (1000 + k, 1000 + k))
    monkeypatch.setenv("PIPEINFER_NODE_CACHE_MAX", "3000")
    assert cache_budget.cache_cap() == 3000
    removed = cache_budget.make_room(1000, keep=[old])  # old is a source of the file to write: kept
    assert [e.path for e in removed] == [mid]
    assert sorted(e.path for e in slice_cache.list_cached()) == sorted([old, new])
    os.utime(new.with_suffix(".json"))  # just used: a running job's
    assert cache_budget.make_room(5000, keep=[old]) == []
    monkeypatch.setenv("PIPEINFER_NODE_CACHE_MAX", "none")
    assert cache_budget.cache_cap() is None and cache_budget.make_room(10**12) == []


@pytest.mark.parametrize("text, want", [("16G", 16 << 30), ("500M", 500 << 20), ("1.5GiB", 3 << 29), ("123", 123),
                                        ("none", None)])
def test_node_cache_sizes(text, want):
    from pipeinfer_cli.models.cache_budget import parse_size

    assert parse_size(text) == want


def test_a_bad_node_cache_cap_is_one_clear_error(monkeypatch):
    from pipeinfer_cli.errors import UsageError
    from pipeinfer_cli.models.cache_budget import cache_cap

    monkeypatch.setenv("PIPEINFER_NODE_CACHE_MAX", "lots")
    with pytest.raises(UsageError, match=r"PIPEINFER_NODE_CACHE_MAX='lots' is not a size; give bytes with an optional "
                                         r"K, M, G or T \(e.g. 16G or 500M\), or `none` for no cap"):
        cache_cap()


def test_the_default_cap_is_16_gib_or_a_quarter_of_the_disk(cache, monkeypatch):
    import shutil

    from pipeinfer_cli.models import cache_budget

    monkeypatch.delenv("PIPEINFER_NODE_CACHE_MAX", raising=False)
    disk = shutil.disk_usage(cache.parent).total
    assert cache_budget.cache_cap() == min(16 << 30, disk // 4)


def test_a_whole_copy_or_a_wider_slice_replaces_the_slices_it_includes(cache):
    from pipeinfer_cli.models import cache_budget, slice_cache

    inner, outer, other = _store(b"i" * 100, layers=(4, 8)), _store(b"o" * 300, layers=(2, 9)), _store(b"x" * 100, layers=(8, 12))
    removed = cache_budget.drop_included(slice_cache.read_entry(outer))
    assert [e.path for e in removed] == [inner] and other.exists() and outer.exists()
    whole = _store(b"w" * 1000, layers=None)
    assert sorted(e.path for e in cache_budget.drop_included(slice_cache.read_entry(whole))) == sorted([outer, other])


def test_prune_max_size_removes_the_least_recently_used_slices(cache):
    old, new = _store(b"o" * 3000, layers=(0, 4)), _store(b"n" * 3000, layers=(4, 8))
    os.utime(old.with_suffix(".json"), (1000, 1000))
    env = {**os.environ, "PIPEINFER_CACHE": str(cache)}
    r = subprocess.run([PIPEINFER, "models", "prune", "--max-size", "4000"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "1 slice and 0 leftover files: freed 3.0 kB" in r.stderr, r.stderr
    assert not old.exists() and new.exists()
    bad = subprocess.run([PIPEINFER, "models", "prune", "--max-size", "big"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("Error: --max-size='big' is not a size"), bad.stderr


def test_the_cap_is_said_in_the_units_it_is_written_in():
    from pipeinfer_cli.models.cache_budget import describe_cap

    assert [describe_cap(c) for c in (16 << 30, 1536 << 20, 500 << 20, 999, None)] == [
        "a cap of 16 GiB", "a cap of 1.5 GiB", "a cap of 500 MiB", "a cap of 999 bytes", "no cap"]

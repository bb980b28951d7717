"""`pipeinfer generate` under real mpiexec (`--ranks R` re-launches the command), as a user runs it.

- Lossless: iterative on 1, 2 and 3 ranks and speculative on 2 ranks print identical tokens,
  greedy and with temperature + seed, on SmolLM2 (its own draft) and on a tiny qwen2 file whose
  draft is a perturbed copy (same vocabulary, so drafts are partly accepted and partly rolled back).
- The tokens equal llama.cpp's own greedy decoding of the same file and prompt tokens.
- Draft == target at temperature 0: every drafted token is accepted, in an exact pattern.
- Bad input: one `Error: ` line on stderr, nothing on stdout, a non-zero exit, no traceback.
- Faults: a rank (head, stage or draft rank) that raises or is killed, a Ctrl-C, a SIGTERM or
  SIGKILL of `pipeinfer` itself, or a closed stdout ends the whole job promptly, error printed
  once, and no process of the job survives.
- Idle ranks do not spin: a stage rank's CPU seconds stay close to its compute seconds.
- scripts/run-hostfile.sh runs on a hostfile of localhost:2.

Every job runs with `--threads 1`: several ranks share the 2 cores of the development machine, and
ggml worker threads that spin on a shared core would make the jobs slow, not wrong.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from jobprocs import assert_no_survivors, finish_job, job_env, marked_pids, wait_first_output
from jobprocs import start_job as start_marked_job
from tinygguf import write_tiny_model

pytestmark = pytest.mark.mpi

PROMPT = "The capital of France is"
N_GEN = 32
N_DRAFT = 4  # generate's default --n-draft
COMMON = ["-p", PROMPT, "-n", N_GEN, "--ctx", 512, "--threads", 1, "--json"]

SAMPLING = {"greedy": [], "temp0.8-seed7": ["--temp", "0.8", "--seed", "7"]}


@dataclass(frozen=True)
class ModelCase:
    target: Path
    draft: Path  # same vocabulary as the target


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gen-mpi")
    return {
        "target": write_tiny_model(d / "target.gguf", arch="qwen2", n_layer=4, seed=0),
        # Same weights at 7/8 of the scale: the draft agrees with the target on about a quarter of
        # the tokens, so speculative decoding both accepts and rolls back.
        "draft": write_tiny_model(d / "draft.gguf", arch="qwen2", n_layer=4, seed=0, scale=0.07),
        "other_vocab": write_tiny_model(d / "vocab512.gguf", arch="qwen2", n_layer=4, seed=1, n_vocab=512),
    }


@pytest.fixture(scope="module")
def models(smollm2_path, tiny_files) -> dict[str, ModelCase]:
    return {
        "smollm2": ModelCase(smollm2_path, smollm2_path),
        "tiny-qwen2": ModelCase(tiny_files["target"], tiny_files["draft"]),
    }


# -- running the command ----------------------------------------------------------------------------

def cli(*args) -> list[str]:
    return [sys.executable, "-m", "pipeinfer_cli", "generate", *map(str, args)]


def run(*args, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    marker = uuid.uuid4().hex
    try:
        return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env=job_env(marker, **env))
    finally:
        assert_no_survivors(marker)


_results: dict[tuple, dict] = {}


def generate_json(case: ModelCase, ranks: int, sampling: str, mode: str = "iterative", draft: Path | None = None,
                  extra: tuple = ()) -> dict:
    """The --json result of one job (cached: several tests look at the same job)."""
    args = [case.target, *COMMON, "--ranks", ranks, "--mode", mode, *SAMPLING[sampling], *extra]
    if mode != "iterative":
        args += ["--draft", draft or case.draft]
    key = tuple(map(str, args))
    if key not in _results:
        r = run(*args)
        assert r.returncode == 0, r.stderr
        _results[key] = json.loads(r.stdout)
    return _results[key]


# -- lossless ---------------------------------------------------------------------------------------

CONFIGS = {  # name -> (ranks, mode)
    "iterative-1": (1, "iterative"),
    "iterative-2": (2, "iterative"),
    "iterative-3": (3, "iterative"),
    "speculative-2": (2, "speculative"),
}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("model", ["smollm2", "tiny-qwen2"])
def test_modes_and_splits_print_identical_tokens(models, model, sampling):
    case = models[model]
    got = {name: generate_json(case, ranks, sampling, mode) for name, (ranks, mode) in CONFIGS.items()}
    want = got["iterative-1"]["tokens"]
    assert len(want) == got["iterative-1"]["n_gen"] > 0
    for name, r in got.items():
        assert r["tokens"] == want, f"{name} diverges from iterative on 1 rank"
        assert len(r["ranks"]) == CONFIGS[name][0]
    spec = got["speculative-2"]["acceptance"]
    assert spec["drafted"] > 0
    if model == "tiny-qwen2" and sampling == "greedy":
        # The perturbed draft must exercise both paths: acceptance and KV rollback.
        assert 0 < spec["accepted"] < spec["drafted"]


def llama_cpp_greedy(path: Path, prompt: list[int], n_new: int) -> list[int]:
    """llama.cpp's greedy tokens: Llama.eval + argmax of the last logits row (no sampler involved)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(prompt)
        out = []
        for _ in range(n_new):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("model", ["smollm2", "tiny-qwen2"])
def test_greedy_output_equals_llama_cpp(models, model):
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    case = models[model]
    got = generate_json(case, 2, "greedy")
    tok = Tokenizer(case.target)
    prompt = tok.encode(PROMPT)
    assert len(prompt) == got["n_prompt"]
    want = llama_cpp_greedy(case.target, prompt, N_GEN)
    n = len(got["tokens"])
    assert got["tokens"] == want[:n]
    if n < N_GEN:  # stopped early: only at end of generation
        assert tok.is_eog(want[n - 1])


@pytest.mark.parametrize("model", ["smollm2", "tiny-qwen2"])
def test_draft_equal_to_target_accepts_every_token(models, model):
    case = models[model]
    r = generate_json(case, 2, "greedy", "speculative", draft=case.target)
    acc, runs = r["acceptance"], r["runs"]
    assert acc["rate"] == 1.0
    assert acc["accepted"] == acc["drafted"] > 0
    assert r["tokens"] == generate_json(case, 1, "greedy")["tokens"]
    if r["n_gen"] == N_GEN:
        # The first token comes from the prompt; each verified run then commits N_DRAFT drafts plus
        # the target's own token, and no token is drafted past -n.
        n_full = (N_GEN - 1) // (N_DRAFT + 1)
        assert runs["speculative"] == n_full
        assert acc["drafted"] == n_full * N_DRAFT
        assert acc["mean_accepted_len"] == N_DRAFT


def test_json_has_every_metric_field(models):
    r = generate_json(models["smollm2"], 2, "greedy", "speculative")
    for key in ("text", "tokens", "mode", "model", "draft", "layer_split", "n_prompt", "n_gen", "ttft_s",
                "tok_per_s", "decode_tok_per_s", "itl_ms", "acceptance", "runs", "ranks"):
        assert key in r, key
    assert set(r["itl_ms"]) >= {"mean", "p50", "p90"}
    assert set(r["acceptance"]) >= {"drafted", "accepted", "rate", "mean_accepted_len"}
    assert set(r["runs"]) >= {"launched", "speculative", "cancelled", "cancelled_mid_compute", "layer_evals_skipped"}
    assert [x["rank"] for x in r["ranks"]] == [0, 1]
    for x in r["ranks"]:
        assert {"role", "layers", "threads", "peak_rss_mib", "busy_s", "cpu_s"} <= set(x)
    assert r["n_gen"] == len(r["tokens"]) and r["mode"] == "speculative"
    # Every rank names ggml's CPU variant it ran, the one this machine's processes load.
    from pipeinfer_cli.native import ggml_cpu

    assert [x["ggml_cpu"] for x in r["ranks"]] == [ggml_cpu()["variant"]] * 2


# -- idle ranks -------------------------------------------------------------------------------------

def test_idle_stage_ranks_do_not_spin(models):
    """Stage ranks holding one layer each wait for the head most of the time; a spinning wait would
    show as CPU seconds far above the seconds spent computing."""
    case = models["smollm2"]
    n_layer = 30
    split = f"{(n_layer - 2) / n_layer:.4f},{1 / n_layer:.4f},{1 / n_layer:.4f}"
    r = run(case.target, "-p", PROMPT, "-n", 128, "--ctx", 512, "--threads", 1, "--json", "--ranks", 3, "--layer-split", split)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    wall = res["n_gen"] / res["tok_per_s"]
    summary = f"{wall:.2f} s of decoding; " + "; ".join(
        f"rank {x['rank']} ({x['role']}, layers {x['layers']}): busy {x['busy_s']:.3f} s, cpu {x['cpu_s']:.3f} s"
        for x in res["ranks"])
    # Polling with backoff costs a few percent of a core; a spinning wait costs all of it (the
    # mpich wheel's blocking Recv: 1 CPU second per second). The bound scales with the job's length
    # so that a slow, loaded machine does not fail it: about 0.75 s for this ~2 s job.
    for x in res["ranks"][1:]:
        assert x["cpu_s"] < x["busy_s"] + 0.25 + 0.25 * wall, summary


# -- bad input --------------------------------------------------------------------------------------

def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


BAD_SPLITS = {  # --layer-split, extra args, words the error must contain
    "count-vs-ranks": ("0.5,0.5", ["--ranks", "3"], ["describes 2 ranks", "--ranks is 3"]),
    "zero": ("0.5,0", [], ["positive"]),
    "negative": ("-0.5,1.5", [], ["positive"]),
    "garbage": ("half,half", [], ["comma-separated numbers"]),
    "two-draft-ranks": ("0.5,0.5/2", [], ["/1"]),
    "more-stages-than-layers": ("1,1,1,1,1", [], ["5 stages", "only 4 layers"]),
}


@pytest.mark.parametrize("name", BAD_SPLITS)
def test_bad_layer_split(tiny_files, name):
    split, extra, needles = BAD_SPLITS[name]
    r = run(tiny_files["target"], "-p", PROMPT, "-n", 8, "--threads", 1, f"--layer-split={split}", *extra, timeout=60)
    assert_one_line_error(r, *needles)


@pytest.mark.parametrize("split", [None, "0.5,0.5/1"], ids=["draft-on-head", "draft-rank"])
def test_a_draft_of_another_vocabulary_is_translated(tiny_files, split):
    """Another vocabulary is no longer refused: the draft's text is re-tokenized for the target
    (test_cross_vocab_mpi.py has the real pairs)."""
    args = ["--ranks", 2] if split is None else [f"--layer-split={split}"]
    want = run(tiny_files["target"], *COMMON, "--ranks", 2, timeout=60)
    got = run(tiny_files["target"], *COMMON, "--mode", "speculative", "--draft", tiny_files["other_vocab"], *args,
              timeout=60)
    assert want.returncode == 0 and got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]
    assert json.loads(got.stdout)["draft_vocab"] == "translated"


def test_prompt_longer_than_ctx(tiny_files):
    r = run(tiny_files["target"], "-p", "hello world " * 60, "-n", 8, "--ctx", 64, "--threads", 1, "--ranks", 2, timeout=60)
    assert_one_line_error(r, "--ctx 64")


@pytest.mark.parametrize("args, needles", [
    (["no-such-model"], ["unknown model 'no-such-model'"]),
    (["/nonexistent/model.gguf"], ["/nonexistent/model.gguf"]),
    (["TARGET", "--mode", "nonsense"], ["nonsense", "iterative"]),
    (["TARGET", "--mode", "speculative", "--ranks", "2"], ["needs a draft"]),
    (["TARGET", "--mode", "speculative", "--draft", "no-such-draft"], ["no-such-draft"]),
], ids=["unknown-model", "missing-file", "unknown-mode", "no-draft", "unknown-draft"])
def test_bad_arguments(tiny_files, args, needles):
    args = [tiny_files["target"] if a == "TARGET" else a for a in args]
    r = run(*args, "-p", PROMPT, "-n", 8, timeout=30)
    assert_one_line_error(r, *needles)
    # Usage errors exit 2, misspelled model names included; a missing file is not one (exit 1).
    assert r.returncode == (1 if "/nonexistent/model.gguf" in args else 2)


# -- faults -----------------------------------------------------------------------------------------

LONG_JOB = ["-p", "The quick brown fox", "-n", 3000, "--ctx", 4096, "--threads", 1]  # a few seconds of decoding


def start_job(target: Path, *args, **env):
    """Start a streaming (non-JSON) job in its own session; return (process, marker)."""
    return start_marked_job(cli(target, *LONG_JOB, *args), **env)


@pytest.mark.parametrize("fail, args", [
    ("1:raise:3", ["--ranks", 2]),
    ("2:raise:3", ["--ranks", 3]),
    ("2:raise:1", ["--layer-split", "0.5,0.5/1", "--mode", "speculative", "--draft", "DRAFT"]),
    ("0:raise:3", ["--ranks", 3]),
    ("1:raise:5", ["--ranks", 3, "--mode", "pipeinfer", "--draft", "DRAFT"]),
    ("2:raise:2", ["--layer-split", "0.5,0.5/1", "--mode", "pipeinfer", "--draft", "DRAFT"]),
    ("2:3", ["--ranks", 3]),  # the deprecated PIPEINFER_DEBUG_FAIL=RANK:N still works
], ids=["stage-of-2", "last-stage-of-3", "draft-rank", "head-of-3", "pipeinfer-stage", "pipeinfer-draft-rank",
        "old-variable"])
def test_a_failing_rank_ends_the_job(tiny_files, fail, args):
    args = [tiny_files["draft"] if a == "DRAFT" else a for a in args]
    var = "PIPEINFER_DEBUG_FAULT" if ":raise:" in fail else "PIPEINFER_DEBUG_FAIL"
    proc, marker = start_job(tiny_files["target"], *args, **{var: fail})
    # The fault fires on a stage's 3rd-5th run (the prompt's two chunks of 16 tokens are its first
    # two), on the 1st/2nd draft proposal or at the head's 3rd token: right after the first token
    # (computed from the prompt) was printed. In pipeinfer mode
    # runs are in flight and being cancelled when it fires.
    wait_first_output(proc)
    rc, _, stderr = finish_job(proc, marker, within_s=10)
    assert rc != 0
    rank = fail.split(":")[0]
    assert stderr.count("injected fault") == 1, stderr
    lines = stderr.strip().splitlines()
    assert lines == [l for l in lines if l.startswith("Error: ")] and len(lines) == 1, stderr
    if rank != "0":  # the head's own failure is reported without a rank
        assert lines[0].startswith(f"Error: rank {rank}: ")


@pytest.mark.parametrize("victim", ["rank1", "rank0"])
def test_a_killed_rank_ends_the_job(tiny_files, victim):
    proc, marker = start_job(tiny_files["target"], "--ranks", 2)
    wait_first_output(proc)
    want = f"PMI_RANK={victim[-1]}\0".encode()
    pids = [p for p in marked_pids(marker) if want in Path(f"/proc/{p}/environ").read_bytes()]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    rc, _, stderr = finish_job(proc, marker, within_s=10)
    assert rc != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in stderr, stderr
    # The killed rank is named (the launcher's own banner names whichever process it saw end first).
    assert f"rank {victim[-1]} ended first" in lines[0], lines[0]


def test_a_rank_dead_of_sigill_says_the_build_does_not_run_here(tiny_files):
    """As ggml's AMX kernels on a VM that does not enable AMX: the last stage raises SIGILL on itself
    (PIPEINFER_DEBUG_FAULT=1:result:2:sigill) after the first token."""
    proc, marker = start_job(tiny_files["target"], "--ranks", 2, PIPEINFER_DEBUG_FAULT="1:result:2:sigill")
    rc, _, stderr = finish_job(proc, marker, within_s=30)
    assert rc != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    # (which rank is named as ending first is the launcher's view, as in test_a_killed_rank_ends_the_job)
    assert lines[0].startswith("Error: the MPI job ended abnormally (") and "Illegal instruction (signal 4)" in lines[0], lines[0]
    assert "died of SIGILL" in lines[0] and "PIPEINFER_GGML_PORTABLE=1 make install" in lines[0]


@pytest.mark.parametrize("how", ["ctrl-c", "sigint-parent", "sigterm-parent"])
def test_interrupt_stops_the_whole_job(tiny_files, how):
    proc, marker = start_job(tiny_files["target"], "--ranks", 2)
    wait_first_output(proc)
    if how == "ctrl-c":  # a terminal sends SIGINT to the foreground process group
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT if how == "sigint-parent" else signal.SIGTERM)
    rc, _, stderr = finish_job(proc, marker, within_s=10)
    assert rc != 0
    assert "Traceback" not in stderr
    assert stderr.count("Error: ") == 1, stderr


def test_a_closed_stdout_stops_the_job_quietly(tiny_files):
    """`pipeinfer generate … | head -c 5`: the job stops when its reader goes away, like SIGPIPE."""
    proc, marker = start_job(tiny_files["target"], "--ranks", 2)
    wait_first_output(proc)
    proc.stdout.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job kept running after its stdout was closed")
    finally:
        assert_no_survivors(marker)
    assert proc.returncode == 128 + signal.SIGPIPE
    assert proc.stderr.read() == b""


def test_killing_the_parent_takes_the_job_down(tiny_files):
    """SIGKILL cannot be forwarded: mpiexec must still not outlive the `pipeinfer` that started it."""
    proc, marker = start_job(tiny_files["target"], "--ranks", 2)
    wait_first_output(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # The orphaned job would otherwise decode for about 5 s more; teardown takes well under a second.
    assert_no_survivors(marker, grace_s=2.5)


# -- cluster scripts --------------------------------------------------------------------------------

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("name", ["run-hostfile.sh", "slurm-generate.sbatch"])
def test_cluster_scripts_parse_and_are_executable(name):
    path = SCRIPTS / name
    assert os.access(path, os.X_OK)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_run_hostfile_on_localhost(tiny_files, tmp_path):
    """scripts/run-hostfile.sh with a hostfile of 'localhost:2': the world size makes 2 ranks."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    marker = uuid.uuid4().hex
    r = subprocess.run([str(SCRIPTS / "run-hostfile.sh"), str(hosts), "2", str(tiny_files["target"]), *map(str, COMMON)],
                       capture_output=True, text=True, timeout=120, env=job_env(marker))
    assert_no_survivors(marker)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert len(got["ranks"]) == 2 and got["n_gen"] == len(got["tokens"]) > 0


# -- the real pair ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_qwen_pair_iterative_equals_speculative_on_bench_prompts(qwen15_path, qwen05_path):
    from pipeinfer_cli.bench.prompts import load_prompts

    prompts = load_prompts()  # the shipped default set (= shared/prompts/bench.jsonl)
    assert prompts
    for p in prompts:
        if p.prompt is not None:
            text = ["-p", p.prompt]
        else:
            assert len(p.messages) == 1 and p.messages[0]["role"] == "user", p.id
            text = ["--chat", p.messages[0]["content"]]
        tokens = {}
        for mode in ("iterative", "speculative"):
            r = run("qwen-coder", *text, "-n", 32, "--ctx", 1024, "--ranks", 2, "--json", "--mode", mode, timeout=600)
            assert r.returncode == 0, r.stderr
            tokens[mode] = json.loads(r.stdout)["tokens"]
        assert tokens["speculative"] == tokens["iterative"], p.id

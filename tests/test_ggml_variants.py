"""ggml's CPU backend reached through its backend registry, in either install:

- one CPU backend built into ggml (`make install`, native or portable): reported as "builtin";
  PIPEINFER_GGML_CPU is refused, naming `GGML_CPU=all`;
- every x86 variant as its own library (`make install GGML_CPU=all`: GGML_BACKEND_DL +
  GGML_CPU_ALL_VARIANTS), the best for this CPU loaded at run time: two different variants, forced
  with PIPEINFER_GGML_CPU, each in its own process, run SmolLM2 split in two layer ranges: in each,
  the native engine decodes exactly llama.cpp's greedy tokens (llama-cpp-python, same variant, same
  process); across the two, the prompt's choices and the first tokens agree (kernels of different
  widths round differently, so a near tie later may not); a variant this CPU cannot run, or one
  not installed, is one Error: line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeinfer_cli.native import ggml_cpu

TESTS = Path(__file__).resolve().parent
N_NEW = 16
N_SAME = 6  # greedy tokens two variants agree on here (7 measured; see the test)

# Greedy tokens of SmolLM2 from the native engine (two stages) and from llama.cpp, in one process.
SNIPPET = """
import json, sys
sys.path.insert(0, {tests!r})
from pipeinfer_cli import _native
from pipeinfer_cli.native import ggml_cpu
from pipeinfer_cli.runtime.tokenizer import Tokenizer
from test_native_parity import llama_cpp_greedy, native_greedy, open_stages

path = {path!r}
cpu = ggml_cpu()
prompt = Tokenizer(path).encode("The three primary colours are")
kv = _native.gguf_metadata(path)["kv"]
stages = open_stages(path, kv[kv["general.architecture"] + ".block_count"], 2, n_threads=2)
logits, native = native_greedy(stages, prompt, {n})
_, llama = llama_cpp_greedy(path, prompt, {n}, n_threads=2, all_rows=False)
print(json.dumps({{"cpu": cpu, "native": native, "llama": llama, "prompt_argmax": logits.argmax(1).tolist()}}))
"""


def _env(variant: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PIPEINFER_GGML_CPU"}
    if variant:
        env["PIPEINFER_GGML_CPU"] = variant
    return env


def _decode(path: Path, variant: str | None) -> dict:
    r = subprocess.run([sys.executable, "-c", SNIPPET.format(tests=str(TESTS), path=str(path), n=N_NEW)],
                       env=_env(variant), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _cli(*args: str, variant: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", *args], env=_env(variant), capture_output=True,
                          text=True, timeout=300)


INFO = ggml_cpu()
per_variant = pytest.mark.skipif(not INFO["dynamic"], reason="ggml has one CPU backend built in: "
                                 "`make install GGML_CPU=all` installs every variant")


def test_this_process_reports_its_cpu_backend():
    assert INFO["variant"] and Path(INFO["library"]).is_file()
    if INFO["dynamic"]:
        assert INFO["variant"] in INFO["available"] and Path(INFO["library"]).name == f"libggml-cpu-{INFO['variant']}.so"
    else:
        assert INFO["variant"] == "builtin" and INFO["available"] == []
    assert any(v == "1" for v in INFO["features"].values()), INFO["features"]


def _two_variants() -> tuple[str, str]:
    """The best variant for this CPU and another one it runs (AVX2 only where the best has more)."""
    best = INFO["variant"]
    for other in ("haswell", "sandybridge", "sse42", "x64"):
        if other != best and other in INFO["available"]:
            return best, other
    pytest.skip(f"no second variant installed ({INFO['available']})")


@per_variant
def test_two_variants_decode_the_same_tokens(smollm2_path):
    best, other = _two_variants()
    a, b = _decode(smollm2_path, best), _decode(smollm2_path, other)
    assert (a["cpu"]["variant"], a["cpu"]["forced"]) == (best, best)
    assert (b["cpu"]["variant"], b["cpu"]["forced"]) == (other, other)
    assert a["cpu"]["features"] != b["cpu"]["features"]  # really two builds of the kernels
    assert a["native"] == a["llama"], "native engine vs llama.cpp under " + best
    assert b["native"] == b["llama"], "native engine vs llama.cpp under " + other
    # Across variants the kernels differ in width (AVX-512 against AVX2) and round differently: on
    # SmolLM2 Q4_1 the prompt's logits differ by up to 0.8 between zen4 and haswell, every row's
    # choice is the same, and greedy decoding agrees for 7 tokens, then a near tie goes the other
    # way. So the same tokens hold within a variant (above), and across them only this far.
    assert a["prompt_argmax"] == b["prompt_argmax"]
    assert a["native"][:N_SAME] == b["native"][:N_SAME] and len(a["native"]) == N_NEW


@per_variant
def test_unforced_loads_the_best_variant_and_version_says_so():
    r = _cli("--version", variant=None)
    assert r.returncode == 0, r.stderr
    assert f"CPU variant {INFO['variant']} (the best for this CPU, of {len(INFO['available'])} installed)" in r.stdout
    forced = _cli("--version", variant="x64")
    assert "CPU variant x64 (PIPEINFER_GGML_CPU" in forced.stdout


@per_variant
def test_a_variant_not_installed_or_not_run_here_is_one_error_line(smollm2_path, tmp_path):
    r = _cli("generate", str(smollm2_path), "-p", "Hi", "-n", "2", variant="pentium")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: PIPEINFER_GGML_CPU=pentium: no such ggml CPU variant"), r.stderr
    assert "installed: " in lines[0] and INFO["variant"] in lines[0]
    flags = Path("/proc/cpuinfo").read_text()
    if "amx_int8" not in flags and "sapphirerapids" in INFO["available"]:
        r = _cli("generate", str(smollm2_path), "-p", "Hi", "-n", "2", variant="sapphirerapids")
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert "this CPU lacks instructions that variant needs" in lines[0]


@pytest.mark.skipif(INFO["dynamic"], reason="a per-variant install takes PIPEINFER_GGML_CPU")
def test_a_builtin_cpu_backend_refuses_a_forced_variant():
    r = _cli("--version", variant="haswell")
    assert r.returncode == 0
    assert "CPU backend: PIPEINFER_GGML_CPU=haswell: this process computes with the CPU backend built into ggml" in r.stdout
    assert "pipeinfer " in _cli("--version", variant=None).stdout
    assert "CPU backend built in" in _cli("--version", variant=None).stdout

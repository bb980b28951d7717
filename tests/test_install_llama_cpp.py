"""scripts/install_llama_cpp.py, the install helper that builds llama-cpp-python for this CPU.

- The flag decision from /proc/cpuinfo text and the environment: native by default; portable
  (GGML_NATIVE=OFF, exactly the CPU's x86 features named, AMX off) on a CPU that reports AMX, with
  PIPEINFER_GGML_PORTABLE=1, or after a venv was made portable; PIPEINFER_GGML_PORTABLE=0 wins.
- Wheels are kept under a key of the flags (and, for a native build, of the CPU), so another set
  of flags never reuses a wheel built for the first one.
- `flags` rewrites <venv>/.ggml-flags only when the choice changes (make's stamp depends on it).
- The probe: a 320-token prompt on Q4_0 and Q8_0 weights through llama_cpp, run for real; and,
  with PIPEINFER_DEBUG_PROBE_SIGILL, a probe child that dies of SIGILL: the native build is
  rebuilt portable (a dry run says so and changes nothing), a portable one is one Error: line.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_llama_cpp.py"


def _helper():
    spec = importlib.util.spec_from_file_location("install_llama_cpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


h = _helper()

# A Sapphire Rapids guest's flags (trimmed) and a Zen 4's: both AVX-512, only the first AMX.
SAPPHIRE = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c "
            "bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 "
            "avx_vnni amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu\n")
ZEN4 = ("processor\t: 0\nflags\t\t: fpu sse sse2 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq "
        "avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni\n")
HASWELL = "flags\t\t: fpu sse sse2 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2\n"


def test_a_cpu_without_amx_gets_the_native_build():
    b = h.decide(ZEN4, {}, "x86_64")
    assert (b.kind, b.cmake_args) == ("native", ["-DGGML_NATIVE=ON"])


def test_a_cpu_with_amx_gets_exactly_its_features_and_no_amx():
    b = h.decide(SAPPHIRE, {}, "x86_64")
    assert b.kind == "portable"
    assert "amx_bf16 amx_int8 amx_tile" in b.reason and "SIGILL" in b.reason
    assert b.cmake_args == ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                            "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON",
                            "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
                            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def test_the_switch_forces_a_portable_build_and_names_every_feature_off_too():
    b = h.decide(HASWELL, {"PIPEINFER_GGML_PORTABLE": "1"}, "x86_64")
    assert b.kind == "portable" and b.reason == "PIPEINFER_GGML_PORTABLE=1"
    on = {a.split("=")[0][2:] for a in b.cmake_args if a.endswith("=ON")}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"}
    # ggml turns these on by default when GGML_NATIVE is off: every option is named, ON or OFF
    assert "-DGGML_AVX512=OFF" in b.cmake_args and "-DGGML_AVX_VNNI=OFF" in b.cmake_args


def test_avx512_needs_every_subset_ggml_compiles_it_with():
    partial = ZEN4.replace(" avx512vl", "")
    assert "-DGGML_AVX512=OFF" in h.decide(partial, {"PIPEINFER_GGML_PORTABLE": "1"}, "x86_64").cmake_args


def test_switch_off_wins_over_amx_and_over_a_remembered_choice():
    for sticky in (None, "PIPEINFER_GGML_PORTABLE=1 was given for this venv before"):
        assert h.decide(SAPPHIRE, {"PIPEINFER_GGML_PORTABLE": "0"}, "x86_64", sticky).kind == "native"
    b = h.decide(ZEN4, {}, "x86_64", sticky="the native build died of SIGILL in the install probe on this machine")
    assert b.kind == "portable" and "died of SIGILL" in b.reason and "PIPEINFER_GGML_PORTABLE=0" in b.reason


def test_user_cmake_args_are_kept_and_keyed():
    b = h.decide(ZEN4, {"CMAKE_ARGS": "-DGGML_OPENMP=OFF"}, "x86_64")
    assert b.extra == ["-DGGML_OPENMP=OFF"] and "-DGGML_OPENMP=OFF" in b.describe()
    assert b.key != h.decide(ZEN4, {}, "x86_64").key


def test_other_architectures_get_a_generic_portable_build():
    b = h.decide("Features\t: fp asimd\n", {"PIPEINFER_GGML_PORTABLE": "1"}, "aarch64")
    assert (b.kind, b.cmake_args) == ("portable", ["-DGGML_NATIVE=OFF"]) and "aarch64" in b.reason


def test_wheel_keys_follow_the_flags_and_the_cpu():
    native_zen, native_haswell = h.decide(ZEN4, {}, "x86_64"), h.decide(HASWELL, {}, "x86_64")
    portable = h.decide(ZEN4, {"PIPEINFER_GGML_PORTABLE": "1"}, "x86_64")
    assert len({native_zen.key, native_haswell.key, portable.key}) == 3  # a native wheel is this CPU's only
    assert h.decide(ZEN4, {}, "x86_64").key == native_zen.key  # stable: the second install reuses it
    # a portable build depends on its flags only: two CPUs with the same features share the wheel
    extra_flag = ZEN4.replace("fpu", "fpu ht")
    assert h.decide(extra_flag, {"PIPEINFER_GGML_PORTABLE": "1"}, "x86_64").key == portable.key
    assert h.decide(ZEN4, {}, "x86_64", requirement="llama-cpp-python==0.3.37").key != native_zen.key


def test_the_pin_comes_from_pyproject():
    assert h.pinned_requirement() == "llama-cpp-python==0.3.36"


def _run(tmp_path: Path, cpuinfo: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEINFER_") and k != "CMAKE_ARGS"}
    full_env.update(env, PIPEINFER_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--cpuinfo", str(tmp_path / "cpuinfo"),
                           "--machine", "x86_64", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, env=full_env, timeout=300)


def test_flags_file_is_rewritten_only_when_the_choice_changes(tmp_path):
    r = _run(tmp_path, ZEN4, "flags")
    assert r.returncode == 0 and r.stdout == r.stderr == ""  # silent: make runs it every time
    flags = tmp_path / ".ggml-flags"
    assert flags.read_text().startswith("native ")
    os.utime(flags, (1, 1))
    _run(tmp_path, ZEN4, "flags")
    assert flags.stat().st_mtime == 1  # unchanged: make's stamp stays up to date
    _run(tmp_path, ZEN4, "flags", PIPEINFER_GGML_PORTABLE="1")
    assert flags.read_text().startswith("portable ") and "-DGGML_AMX_TILE=OFF" in flags.read_text()


def test_install_dry_run_says_which_build_and_why(tmp_path):
    r = _run(tmp_path, SAPPHIRE, "install", "--dry-run")
    assert r.returncode == 0, r.stderr
    first, second = r.stderr.strip().splitlines()
    assert first.startswith("llama-cpp-python: portable ggml build (this CPU reports amx_bf16 amx_int8 amx_tile")
    assert "-DGGML_NATIVE=OFF" in first and "-DGGML_AMX_INT8=OFF" in first
    key = h.decide(SAPPHIRE, {}, "x86_64", py_tag=h.python_tag()).key
    assert second == f"dry run: would build a wheel into {tmp_path / 'cache' / 'wheels' / key}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpuinfo"]  # nothing written


def test_probe_runs_a_long_quantized_prompt_through_llama_cpp(tmp_path):
    """The install probe for real: 320 tokens in one batch on Q4_0 and Q8_0 weights."""
    r = _run(tmp_path, ZEN4, "probe", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("ggml probe: a 320-token prompt on Q4_0 and Q8_0 weights ran")


def test_a_native_build_that_dies_of_sigill_is_rebuilt_portable(tmp_path):
    r = _run(tmp_path, ZEN4, "probe", "--dry-run", PIPEINFER_DEBUG_PROBE_SIGILL="native")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == ("llama-cpp-python: the native ggml build died of SIGILL (Illegal instruction) on a 320-token "
                        "prompt; rebuilding it portable (GGML_NATIVE=OFF, this CPU's features named, no AMX)")
    assert lines[1].startswith("llama-cpp-python: portable ggml build (the native build died of SIGILL in the install "
                               "probe on this machine; PIPEINFER_GGML_PORTABLE=0 builds native again)")
    assert "-DGGML_AVX512=ON" in lines[1] and "-DGGML_AMX_TILE=OFF" in lines[1]
    assert lines[2].startswith("dry run: would build it into ") and len(lines) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpuinfo"]


def test_a_portable_build_that_dies_too_is_one_error(tmp_path):
    r = _run(tmp_path, ZEN4, "probe", "--dry-run", PIPEINFER_DEBUG_PROBE_SIGILL="1", PIPEINFER_GGML_PORTABLE="1")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "Error: the portable ggml build also dies of SIGILL (Illegal instruction) on a 320-token prompt on this CPU")


def test_the_native_only_switch_leaves_a_portable_build_alone(tmp_path):
    r = _run(tmp_path, ZEN4, "probe", "--dry-run", PIPEINFER_DEBUG_PROBE_SIGILL="native", PIPEINFER_GGML_PORTABLE="1")
    assert r.returncode == 0 and r.stderr.startswith("ggml probe: a 320-token prompt"), r.stderr


# -- every CPU variant (GGML_CPU=all) -----------------------------------------------------------------

ALL = {"PIPEINFER_GGML_VARIANTS": "all"}


def test_every_variant_is_one_build_for_every_cpu():
    b = h.decide(ZEN4, ALL, "x86_64")
    assert (b.kind, b.cmake_args) == ("all", ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
                                              "-DGGML_BACKEND_DIR:STRING=llama_cpp/lib"])
    assert "every x86 variant" in b.reason
    # one wheel whatever the CPU that builds it (AMX or not): the key ignores the CPU's flags
    assert h.decide(HASWELL, ALL, "x86_64").key == b.key == h.decide(SAPPHIRE, ALL, "x86_64").key
    assert b.key not in {h.decide(ZEN4, {}, "x86_64").key, h.decide(ZEN4, {"PIPEINFER_GGML_PORTABLE": "1"}, "x86_64").key}


def test_every_variant_is_remembered_until_one_is_asked_for():
    why = "PIPEINFER_GGML_VARIANTS=all (GGML_CPU=all) was given for this venv before"
    b = h.decide(ZEN4, {}, "x86_64", sticky_all=why)
    assert b.kind == "all" and "GGML_CPU=one goes back" in b.reason
    assert h.decide(ZEN4, {"PIPEINFER_GGML_VARIANTS": "one"}, "x86_64", sticky_all=why).kind == "native"
    # a venv made portable before takes every variant when asked (they are portable too)
    assert h.decide(ZEN4, ALL, "x86_64", sticky="PIPEINFER_GGML_PORTABLE=1 was given for this venv before").kind == "all"


def test_every_variant_refuses_what_cannot_work():
    with pytest.raises(SystemExit, match=r"PIPEINFER_GGML_VARIANTS=some .*use all .* or one"):
        h.decide(ZEN4, {"PIPEINFER_GGML_VARIANTS": "some"}, "x86_64")
    with pytest.raises(SystemExit, match="two different builds"):
        h.decide(ZEN4, {**ALL, "PIPEINFER_GGML_PORTABLE": "1"}, "x86_64")
    with pytest.raises(SystemExit, match="x86 CPU variants; this machine is aarch64"):
        h.decide("Features\t: fp asimd\n", ALL, "aarch64")


def test_flags_file_remembers_every_variant(tmp_path):
    _run(tmp_path, ZEN4, "flags", **ALL)
    assert (tmp_path / ".ggml-flags").read_text().startswith("all ")
    assert (tmp_path / ".ggml-variants").is_file()
    _run(tmp_path, ZEN4, "flags")  # a plain `make install` keeps it
    assert (tmp_path / ".ggml-flags").read_text().startswith("all ")
    _run(tmp_path, ZEN4, "flags", PIPEINFER_GGML_VARIANTS="one")
    assert (tmp_path / ".ggml-flags").read_text().startswith("native ")
    assert not (tmp_path / ".ggml-variants").exists()


def test_a_variant_that_dies_in_the_probe_is_left_out(tmp_path):
    from pipeinfer_cli.native import ggml_cpu

    cpu = ggml_cpu()
    if not cpu["dynamic"]:
        pytest.skip("ggml has one CPU backend built in: `make install GGML_CPU=all` installs every variant")
    r = _run(tmp_path, ZEN4, "probe", "--dry-run", PIPEINFER_DEBUG_PROBE_SIGILL=cpu["variant"], **ALL)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"llama-cpp-python: ggml's CPU variant {cpu['variant']} died of SIGILL (Illegal instruction) on a 320-token "
        f"prompt on this machine; leaving it out (moved to {tmp_path / '.ggml-excluded'}) and probing the next best"]
    r = _run(tmp_path, ZEN4, "probe", "--dry-run", **ALL)
    assert r.returncode == 0 and f"build: all, CPU variant {cpu['variant']})" in r.stderr, r.stderr

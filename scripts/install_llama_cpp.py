#!/usr/bin/env python3
"""Build and install the pinned llama-cpp-python for this CPU, then check that its ggml runs here.

`make install` runs this with the venv's python, in three steps:

    install_llama_cpp.py flags    # the build this CPU gets; rewrites <venv>/.ggml-flags only when it changes
    install_llama_cpp.py install  # builds the wheel (once per set of flags) and installs it
    install_llama_cpp.py probe    # a 320-token prompt on quantized weights; a build that dies of a
                                  # signal there is rebuilt portable

Which build: ggml's native one (`-march=native`, GGML_NATIVE=ON) by default. A CPU whose
/proc/cpuinfo reports AMX (`amx_tile`, `amx_int8`, `amx_bf16`), or `PIPEINFER_GGML_PORTABLE=1`,
gets a portable one: GGML_NATIVE=OFF and exactly the x86 features the CPU reports named (AVX,
AVX2, FMA, F16C, BMI2, AVX-512 and its VBMI/VNNI/BF16, AVX-VNNI), AMX off. ggml's AMX matmul
kernels, compiled in by `-march=native`, die of SIGILL (`tilezero`) on machines whose kernel grants
AMX but whose hypervisor does not enable it, on every prompt long enough to use them.

Every variant: `PIPEINFER_GGML_VARIANTS=all` (`make install GGML_CPU=all`) builds ggml's CPU backend
once for each x86 variant llama.cpp's release builds ship (GGML_BACKEND_DL=ON, GGML_CPU_ALL_VARIANTS=ON,
GGML_NATIVE=OFF: libggml-cpu-<variant>.so beside libggml.so), and each process loads the one whose
score is best on its CPU (pipeinfer's native extension does it, through ggml's backend registry;
PIPEINFER_GGML_CPU=<variant> forces one). The wheel depends on no CPU, so one install serves
every node of a cluster whatever its CPU. The choice is remembered in the venv (<venv>/.ggml-variants);
`PIPEINFER_GGML_VARIANTS=one` (`GGML_CPU=one`) goes back to one build. A variant that dies of SIGILL
in the probe (AMX where a hypervisor does not enable it) is moved out of the install into
<venv>/.ggml-excluded/ and the probe runs again with the next best.

Wheels are kept in <cache>/wheels/<key>/ (<cache>: PIPEINFER_CACHE, else $XDG_CACHE_HOME/pipeinfer,
else ~/.cache/pipeinfer); the key covers the pinned version, the Python tag, the CMake flags and,
for a native build, the CPU's flags. pip's own wheel cache is not used: its key ignores CMAKE_ARGS,
so a rebuild with other flags would silently reinstall the old wheel.

`PIPEINFER_GGML_PORTABLE=1` is remembered in the venv (<venv>/.ggml-portable), so a later plain
`make install` keeps the portable build; `PIPEINFER_GGML_PORTABLE=0` forgets it and builds native
(even on an AMX CPU, for one where AMX works). If the probe dies of a signal with the native build,
the helper records that the same way, rebuilds portable and probes again; if that fails too it prints one `Error:` line and exits 1.
`--dry-run` prints what it would do and changes nothing. `PIPEINFER_DEBUG_PROBE_SIGILL=1` makes
the probe's child raise SIGILL on itself (`=native`: only with a native build), so the rebuild path
can be tried on a CPU without AMX.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE_TOKENS = 320
PROBE_TIMEOUT_S = 600

# /proc/cpuinfo flag(s) -> ggml's CMake option. AVX512 needs every flag ggml compiles it with
# (-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw).
X86_FEATURES: list[tuple[str, tuple[str, ...]]] = [
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
]
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# llama.cpp's release builds: a CPU backend library per x86 variant, the best loaded at run time.
# GGML_BACKEND_DIR is where ggml installs them (relative to the wheel's root: beside libggml.so in
# llama_cpp/lib, not in bin/); pipeinfer loads them from libggml.so's directory, wherever that is.
# Typed STRING: ggml declares it a PATH, which CMake would make absolute in the unpacked sdist.
ALL_VARIANTS_ARGS = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
                     "-DGGML_BACKEND_DIR:STRING=llama_cpp/lib"]
VARIANT_PREFIX = "libggml-cpu-"
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")


def pinned_requirement() -> str:
    """The llama-cpp-python requirement of pyproject.toml (one place says which version)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for d in deps:
        if re.match(r"llama-cpp-python\s*==", d):
            return d.replace(" ", "")
    raise SystemExit("Error: pyproject.toml pins no llama-cpp-python==VERSION; add the pin back")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo text (x86 `flags`, ARM `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def portable_args(flags: set[str], machine: str) -> list[str]:
    """GGML_NATIVE=OFF with every x86 feature the CPU reports ON, the others and AMX OFF."""
    args = ["-DGGML_NATIVE=OFF"]
    if machine.lower() in X86_MACHINES:
        for option, needs in X86_FEATURES:
            args.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
        args += [f"-D{option}=OFF" for option in AMX_OPTIONS]
    return args


@dataclass
class Build:
    kind: str  # "native" or "portable"
    cmake_args: list[str]
    reason: str
    key: str = ""
    extra: list[str] = field(default_factory=list)  # the user's own CMAKE_ARGS, appended

    def describe(self) -> str:
        flags = " ".join(self.cmake_args + self.extra)
        name = "per-variant" if self.kind == "all" else self.kind
        return f"llama-cpp-python: {name} ggml build ({self.reason}): CMAKE_ARGS=\"{flags}\""

    def flags_file_text(self) -> str:
        return f"{self.kind} {self.key} {' '.join(self.cmake_args + self.extra)}\n"


FALSY = ("0", "false", "no", "off")


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def all_variants(env: dict, machine: str, sticky_all: str | None, extra: list[str], flags: set[str],
                 requirement: str, py_tag: str) -> Build | None:
    """The build with every CPU variant when PIPEINFER_GGML_VARIANTS=all asks for it (or asked once
    for this venv), else None."""
    variants = (env.get("PIPEINFER_GGML_VARIANTS") or "").strip().lower()
    if variants not in ("", "all", "one"):
        raise SystemExit(f"Error: PIPEINFER_GGML_VARIANTS={variants} (make's GGML_CPU): use all (every CPU variant, "
                         "chosen at run time) or one (one build for this CPU)")
    if variants == "one" or not (variants == "all" or sticky_all):
        return None
    if truthy(env.get("PIPEINFER_GGML_PORTABLE")):
        raise SystemExit("Error: PIPEINFER_GGML_PORTABLE=1 and PIPEINFER_GGML_VARIANTS=all (GGML_CPU=all) ask for "
                         "two different builds; give one of them")
    if machine.lower() not in X86_MACHINES:
        raise SystemExit(f"Error: GGML_CPU=all builds ggml's x86 CPU variants; this machine is {machine}: "
                         "use GGML_CPU=one")
    why = "PIPEINFER_GGML_VARIANTS=all" if variants else f"{sticky_all}; GGML_CPU=one goes back to one build"
    build = Build("all", list(ALL_VARIANTS_ARGS), f"{why}: every x86 variant, the best for the CPU loaded at run time",
                  extra=extra)
    build.key = build_key(build, flags, requirement, py_tag)
    return build


def decide(cpuinfo: str, env: dict, machine: str, sticky: str | None = None,
           requirement: str = "llama-cpp-python==0.3.36", py_tag: str = "", sticky_all: str | None = None) -> Build:
    """The build this CPU gets, and why. sticky: why this venv was made portable before
    (PIPEINFER_GGML_PORTABLE=1 once, or a native build that died in the probe), kept until
    PIPEINFER_GGML_PORTABLE=0 asks for the native build again. sticky_all: why this venv has
    every CPU variant (PIPEINFER_GGML_VARIANTS=all once), kept until PIPEINFER_GGML_VARIANTS=one."""
    flags = cpu_flags(cpuinfo)
    extra = (env.get("CMAKE_ARGS") or "").split()
    every = all_variants(env, machine, sticky_all, extra, flags, requirement, py_tag)
    if every is not None:
        return every
    amx = sorted(f for f in flags if f.startswith("amx"))
    switch = (env.get("PIPEINFER_GGML_PORTABLE") or "").strip().lower()
    native = Build("native", ["-DGGML_NATIVE=ON"], "the default: ggml tuned to this CPU", extra=extra)
    if switch in FALSY:
        native.reason = f"PIPEINFER_GGML_PORTABLE={switch}"
    native.key = build_key(native, flags, requirement, py_tag)
    if truthy(switch):
        reason = f"PIPEINFER_GGML_PORTABLE={switch}"
    elif switch in FALSY:
        return native
    elif sticky:
        reason = f"{sticky}; PIPEINFER_GGML_PORTABLE=0 builds native again"
    elif amx:
        reason = (f"this CPU reports {' '.join(amx)}: ggml's AMX kernels die of SIGILL where a hypervisor "
                  "does not enable AMX, so AMX is left out")
    else:
        return native
    if machine.lower() not in X86_MACHINES:
        reason += f"; no feature list for {machine}: ggml's generic flags"
    build = Build("portable", portable_args(flags, machine), reason, extra=extra)
    build.key = build_key(build, flags, requirement, py_tag)
    return build


def build_key(build: Build, flags: set[str], requirement: str, py_tag: str) -> str:
    """A native build depends on the CPU it was built on; a portable one only on its flags."""
    parts = [requirement, py_tag, *build.cmake_args, *build.extra]
    if build.kind == "native":
        parts += ["cpu:", *sorted(flags)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def python_tag() -> str:
    return f"{sys.implementation.cache_tag}-{platform.machine()}-{sys.platform}"


def cache_dir(env: dict) -> Path:
    if env.get("PIPEINFER_CACHE"):
        return Path(env["PIPEINFER_CACHE"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipeinfer"


class Helper:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = Path(args.state_dir or sys.prefix)
        self.env = dict(os.environ)
        self.cpuinfo = Path(args.cpuinfo).read_text() if Path(args.cpuinfo).exists() else ""
        self.machine = args.machine or platform.machine()
        self.requirement = pinned_requirement()

    # -- state in the venv
    @property
    def record_path(self) -> Path:
        return self.state / ".ggml-build.json"

    @property
    def sticky_path(self) -> Path:
        return self.state / ".ggml-portable"

    @property
    def variants_path(self) -> Path:
        return self.state / ".ggml-variants"

    def sticky(self) -> str | None:
        try:
            return self.sticky_path.read_text().strip() or None
        except OSError:
            return None

    def sticky_all(self) -> str | None:
        try:
            return self.variants_path.read_text().strip() or None
        except OSError:
            return None

    def decide(self, sticky: str | None = None) -> Build:
        return decide(self.cpuinfo, self.env, self.machine, sticky or self.sticky(), self.requirement, python_tag(),
                      sticky_all=self.sticky_all())

    def installed(self) -> dict:
        try:
            return json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return {}

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # -- flags
    def flags(self) -> int:
        build = self.decide()
        path = self.state / ".ggml-flags"
        text = build.flags_file_text()
        if self.args.print:
            print(build.describe())
        if not self.args.dry_run:
            self.remember_choice(build)
        old = path.read_text() if path.exists() else None
        if old != text and not self.args.dry_run:
            path.write_text(text)
        return 0

    # -- install
    def wheel_dir(self, build: Build) -> Path:
        return cache_dir(self.env) / "wheels" / build.key

    def wheel(self, build: Build) -> Path | None:
        found = sorted(self.wheel_dir(build).glob("llama_cpp_python-*.whl"))
        return found[0] if found else None

    def install(self, build: Build | None = None) -> int:
        build = build or self.decide()
        if not self.args.dry_run:
            self.remember_choice(build)
        rec = self.installed()
        if rec.get("key") == build.key and self.llama_cpp_present():
            return 0
        if (not rec and build.kind == "native" and not build.extra and self.llama_cpp_present()
                and not self.args.dry_run):
            # A venv from before this helper: its llama-cpp-python is pip's native build; the probe checks it.
            self.record(build, adopted=True)
            self.say(f"llama-cpp-python: keeping the native build installed before ({self.requirement})")
            return 0
        wheel = self.wheel(build)
        self.say(build.describe())
        if self.args.dry_run:
            self.say(f"dry run: would {'install ' + str(wheel) if wheel else 'build a wheel into ' + str(self.wheel_dir(build))}")
            return 0
        if wheel is None:
            wheel = self.build_wheel(build)
        else:
            self.say(f"llama-cpp-python: reusing {wheel}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
                            str(wheel)])
        if r.returncode != 0:
            raise SystemExit(f"Error: installing {wheel} failed (pip exit status {r.returncode}, its output above); "
                             f"delete {wheel.parent} and run make install again to rebuild it")
        if build.kind == "all" and not self.variant_files():
            raise SystemExit(f"Error: {wheel} holds no {VARIANT_PREFIX}*.so: this llama-cpp-python's build did not "
                             "install ggml's CPU variants; use GGML_CPU=one")
        self.record(build)
        return 0

    def variant_files(self, variant: str = "*") -> list[Path]:
        """The installed files of one CPU variant (or of all), in every directory the package has them."""
        from importlib import metadata

        try:
            dist = metadata.distribution("llama-cpp-python")
        except metadata.PackageNotFoundError:
            return []
        import fnmatch

        pattern = f"{VARIANT_PREFIX}{variant}.so"
        return [Path(dist.locate_file(f)) for f in dist.files or [] if fnmatch.fnmatch(Path(f).name, pattern)
                and Path(dist.locate_file(f)).exists()]

    def exclude_variant(self, variant: str) -> None:
        """Moves a variant's libraries out of the install (into <venv>/.ggml-excluded/), so ggml never loads it."""
        dest = self.state / ".ggml-excluded"
        dest.mkdir(exist_ok=True)
        for f in self.variant_files(variant):
            shutil.move(str(f), str(dest / f"{f.parent.name}-{f.name}"))

    def remember_choice(self, build: Build) -> None:
        """PIPEINFER_GGML_PORTABLE=1 stays chosen for this venv (a later plain `make install` must not
        go back to a build that crashed); =0 forgets it."""
        switch = (self.env.get("PIPEINFER_GGML_PORTABLE") or "").strip().lower()
        if build.kind == "portable" and truthy(switch):
            self.sticky_path.write_text("PIPEINFER_GGML_PORTABLE=1 was given for this venv before\n")
        elif switch in FALSY:
            self.sticky_path.unlink(missing_ok=True)
        variants = (self.env.get("PIPEINFER_GGML_VARIANTS") or "").strip().lower()
        if build.kind == "all" and variants == "all":
            self.variants_path.write_text("PIPEINFER_GGML_VARIANTS=all (GGML_CPU=all) was given for this venv before\n")
        elif variants == "one":
            self.variants_path.unlink(missing_ok=True)

    def llama_cpp_present(self) -> bool:
        from importlib import metadata

        try:
            return f"llama-cpp-python=={metadata.version('llama-cpp-python')}" == self.requirement
        except metadata.PackageNotFoundError:
            return False

    def record(self, build: Build, adopted: bool = False, excluded: list[str] | None = None) -> None:
        self.record_path.write_text(json.dumps({"key": build.key, "kind": build.kind, "reason": build.reason,
                                                "cmake_args": build.cmake_args + build.extra,
                                                "adopted": adopted, "excluded": excluded or []}, indent=1) + "\n")
        (self.state / ".ggml-flags").write_text(build.flags_file_text())

    def build_wheel(self, build: Build) -> Path:
        dest = self.wheel_dir(build)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{build.key}.", dir=dest.parent))
        env = dict(self.env, CMAKE_ARGS=" ".join(build.cmake_args + build.extra))
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        self.say(f"llama-cpp-python: compiling {self.requirement} from source (about 7 minutes on 2 cores)")
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-cache-dir",
                                "--no-binary", "llama-cpp-python", "--wheel-dir", str(tmp), self.requirement],
                               env=env)
            if r.returncode != 0:
                raise SystemExit(f"Error: building {self.requirement} failed (pip wheel exit status {r.returncode}, "
                                 "its output above); fix the compiler error and run make install again")
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.say(f"llama-cpp-python: built in {time.monotonic() - t0:.0f} s, kept in {dest}")
        return self.wheel(build)

    # -- probe
    def run_probe(self, build_kind: str) -> tuple[int, str]:
        """(exit status, its line) of the probe child; a negative status: killed by that signal.
        self.variant: the CPU variant the child computed with (a per-variant build), else None."""
        env = dict(self.env, PIPEINFER_PROBE_BUILD=build_kind)
        self.variant = None
        try:
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "probe-child"], env=env,
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return 1, f"no answer in {PROBE_TIMEOUT_S} s"
        for said in r.stderr.splitlines():
            if said.startswith(VARIANT_LINE):
                self.variant = said[len(VARIANT_LINE):].strip() or None
        if r.returncode == 0:
            return 0, r.stdout.strip() or "ggml probe: ok"
        return r.returncode, (r.stderr.strip().splitlines() or ["no output"])[-1]

    def probe_error(self, rc: int, line: str, kind: str) -> str:
        """The Error: line for a probe that failed other than by the SIGILL a rebuild may cure."""
        if rc > 0:  # an error of its own, not a crash
            return (f"Error: the ggml install probe failed ({line}); run `{sys.executable} "
                    f"{Path(__file__).resolve()} probe-child` to see it whole")
        fix = ("report it with /proc/cpuinfo's flags line (CMAKE_ARGS=... make install adds flags of your own)"
               if kind != "native" else "try `PIPEINFER_GGML_PORTABLE=1 make install`, else report it")
        also = "also " if kind == "portable" else ""
        name = "per-variant" if kind == "all" else kind
        return (f"Error: the {name} ggml build {also}dies of {died_of(rc)} on a {PROBE_TOKENS}-token prompt "
                f"on this CPU; {fix}")

    def probe_variants(self, rec: dict) -> int:
        """A per-variant build: the probe runs with the variant ggml picks for this CPU; one that dies
        of SIGILL (AMX a hypervisor does not enable) is left out and the next best probed."""
        excluded = list(rec.get("excluded") or [])
        for _ in range(64):  # more than ggml has variants
            rc, line = self.run_probe("all")
            if rc == 0:
                self.say(line)
                return 0
            if rc != -signal.SIGILL or not self.variant:
                self.say(self.probe_error(rc, line, "all"))
                return 1
            self.say(f"llama-cpp-python: ggml's CPU variant {self.variant} died of {died_of(rc)} on a {PROBE_TOKENS}-token "
                     f"prompt on this machine; leaving it out (moved to {self.state / '.ggml-excluded'}) and probing "
                     "the next best")
            if self.args.dry_run:
                return 0
            self.exclude_variant(self.variant)
            excluded.append(self.variant)
            rec["excluded"] = excluded
            self.record_path.write_text(json.dumps(rec, indent=1) + "\n")
        self.say(f"Error: every ggml CPU variant dies in the install probe ({', '.join(excluded)})")
        return 1

    def probe(self) -> int:
        rec = self.installed()
        kind = rec.get("kind") or self.decide().kind
        if kind == "all":
            return self.probe_variants(rec)
        rc, line = self.run_probe(kind)
        if rc == 0:
            self.say(line)
            return 0
        if rc != -signal.SIGILL or kind != "native":  # a rebuild cures an illegal instruction only
            self.say(self.probe_error(rc, line, kind))
            return 1
        why = "the native build died of SIGILL in the install probe on this machine"
        portable = self.decide(sticky=why)
        self.say(f"llama-cpp-python: the native ggml build died of {died_of(rc)} on a {PROBE_TOKENS}-token prompt; "
                 "rebuilding it portable (GGML_NATIVE=OFF, this CPU's features named, no AMX)")
        if self.args.dry_run:
            self.say(portable.describe())
            self.say(f"dry run: would build it into {self.wheel_dir(portable)}, install it and probe again")
            return 0
        self.sticky_path.write_text(why + "\n")
        self.install(portable)
        rc, line = self.run_probe(portable.kind)
        if rc != 0:
            self.say(self.probe_error(rc, line, portable.kind))
            return 1
        self.say(line)
        return 0


def died_of(rc: int) -> str:
    if rc < 0:
        try:
            sig = signal.Signals(-rc)
        except ValueError:
            return f"signal {-rc}"
        return f"{sig.name} ({signal.strsignal(sig) or sig.name})"
    return f"exit status {rc}"


VARIANT_LINE = "ggml probe: CPU variant "


def load_cpu_variant(llama_cpp) -> str | None:
    """Registers ggml's CPU backend as the native extension does (src/cpu_backend.cpp), through
    llama_cpp's libggml: a per-variant build has none until then. The variant loaded, else None."""
    import ctypes

    lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    # The file libllama maps by its soname (libggml.so.0): the wheel's libggml.so is a copy, another
    # object with a registry of its own (llama_cpp._ggml loads that one).
    sonames = sorted(p for p in lib_dir.glob("libggml.so.*") if re.fullmatch(r"libggml\.so\.\d+", p.name))
    libggml = ctypes.CDLL(str(sonames[0] if sonames else lib_dir / "libggml.so"))
    libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    if not libggml.ggml_backend_dev_by_type(0):  # GGML_BACKEND_DEVICE_TYPE_CPU
        forced = os.environ.get("PIPEINFER_GGML_CPU", "").strip()
        if forced:
            libggml.ggml_backend_load.restype = ctypes.c_void_p
            libggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
            libggml.ggml_backend_load(str(lib_dir / f"{VARIANT_PREFIX}{forced}.so").encode())
        else:
            libggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
            libggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
    with open("/proc/self/maps") as maps:  # ggml keeps the variant it chose mapped, and no other
        names = {Path(line.split()[-1]).name for line in maps if VARIANT_PREFIX in line}
    variants = sorted(n[len(VARIANT_PREFIX):-len(".so")] for n in names if n.endswith(".so"))
    return variants[0] if len(variants) == 1 else None


def probe_child() -> int:
    """In a child process: a PROBE_TOKENS-token prompt in one batch through llama.cpp on tiny random
    Q4_0 and Q8_0 models (the types and batch sizes ggml's AMX kernels take), logits checked finite."""
    mode = os.environ.get("PIPEINFER_DEBUG_PROBE_SIGILL", "").strip().lower()
    if truthy(mode) or (mode == "native" and os.environ.get("PIPEINFER_PROBE_BUILD") == "native"):
        os.kill(os.getpid(), signal.SIGILL)
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from tinygguf import write_tiny_model

    import llama_cpp

    variant = load_cpu_variant(llama_cpp)
    if variant:
        print(VARIANT_LINE + variant, file=sys.stderr, flush=True)
        if mode == variant:  # PIPEINFER_DEBUG_PROBE_SIGILL=<variant>: that variant "dies" here
            os.kill(os.getpid(), signal.SIGILL)
    t0 = time.monotonic()
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 256, PROBE_TOKENS)]
    with tempfile.TemporaryDirectory(prefix="pipeinfer-probe-") as d:
        for qtype in ("q4_0", "q8_0"):
            path = write_tiny_model(Path(d) / f"{qtype}.gguf", arch="llama", n_layer=2, n_embd=128, n_head=4,
                                    n_head_kv=2, n_ff=256, n_vocab=320, n_ctx_train=1024, weight_type=qtype)
            llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=os.cpu_count() or 2,
                                  verbose=False)
            try:
                llm.eval(prompt)
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
                if not np.isfinite(logits).all():
                    print(f"{qtype}: non-finite logits", file=sys.stderr)
                    return 2
            finally:
                llm.close()
    print(f"ggml probe: a {PROBE_TOKENS}-token prompt on Q4_0 and Q8_0 weights ran "
          f"({(time.monotonic() - t0) * 1000:.0f} ms, build: {os.environ.get('PIPEINFER_PROBE_BUILD', '?')}"
          f"{f', CPU variant {variant}' if variant else ''})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["flags", "install", "probe", "probe-child"])
    p.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    p.add_argument("--print", action="store_true", help="flags: print the decision")
    p.add_argument("--cpuinfo", default="/proc/cpuinfo", help="read CPU flags from this file")
    p.add_argument("--machine", default=None, help="the architecture (default: this machine's)")
    p.add_argument("--state-dir", default=None, help="where the venv's build record lives (default: sys.prefix)")
    args = p.parse_args(argv)
    if args.command == "probe-child":
        return probe_child()
    h = Helper(args)
    return {"flags": h.flags, "install": h.install, "probe": h.probe}[args.command]()


if __name__ == "__main__":
    sys.exit(main())

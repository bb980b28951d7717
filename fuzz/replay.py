"""Run saved inputs through a fuzz target, with the limits of the campaign (no fuzzing).

    .venv/bin/python fuzz/replay.py TARGET FILE_OR_DIR...

Prints one line per input (`ok`, or the `Error:` line the CLI would print) and exits 0 when every
input ended in success or a typed error. An input that raises anything else prints its traceback
and exits 1; one that runs longer than --timeout seconds exits 3; a native crash kills the process
(the file being run was printed just before, flushed).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import targets  # noqa: E402

MEMORY_LIMIT = 4 << 30  # address space: a few hundred MB of Python, llama.cpp and ggml, plus margin


def limit_memory(limit: int = MEMORY_LIMIT) -> None:
    """Cap the address space, so that a blow-up ends in MemoryError (a finding) instead of swapping.

    Not under AddressSanitizer (`make asan` preloads libasan): its shadow memory reserves terabytes
    of address space, and it reports blow-ups itself."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _files(args: list[str]) -> list[Path]:
    out: list[Path] = []
    for a in args:
        p = Path(a)
        out += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return out


def _on_timeout(_signum, _frame):
    raise TimeoutError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=targets.TARGETS)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per input (default 5)")
    args = ap.parse_args()
    limit_memory()
    faulthandler.enable()
    signal.signal(signal.SIGALRM, _on_timeout)
    from pipeinfer_cli.errors import PipeinferError, describe

    files = _files(args.paths)
    t0 = time.monotonic()
    for path in files:
        print(f"{args.target} {path}: ", end="", flush=True)
        data = path.read_bytes()
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
        try:
            targets.run_checked(args.target, data)
            print("ok", flush=True)
        except PipeinferError as e:
            print(f"Error: {describe(e)}", flush=True)
        except TimeoutError:
            print(f"HANG: more than {args.timeout:g} s", flush=True)
            return 3
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    targets.cleanup()
    dt = time.monotonic() - t0
    print(f"{args.target}: {len(files)} inputs, every one ended in success or an Error: line ({dt:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Coverage-guided fuzzing of pipeinfer's GGUF readers (atheris / libFuzzer).

    .venv/bin/python fuzz/fuzz_gguf.py TARGET [libFuzzer options] [CORPUS_DIR...]

TARGET is metadata, native or tokenizer (fuzz/targets.py). `make fuzz` runs all three with the
campaign's options: -runs=100000 -timeout=5 (a hang: more than 5 s on one input) -rss_limit_mb
(a memory blow-up), the working corpus in build/fuzz/corpus/TARGET and the committed seeds.
Mutations are structure-aware (fuzz/mutator.py): GGUF fields, not only random bytes. Coverage
feedback comes from pipeinfer's, llama-cpp-python's and jinja2's Python code (atheris instruments
bytecode); the C++ of ggml, llama.cpp and the native extension is not instrumented (that needs
clang's -fsanitize=fuzzer-no-link; gcc is the compiler here), so there the structure-aware
mutator does the work.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import atheris  # noqa: E402

import replay  # noqa: E402

with atheris.instrument_imports(include=["pipeinfer_cli", "llama_cpp", "jinja2", "targets"]):
    import targets
    from pipeinfer_cli.cli import inspect_cmd  # noqa: F401  (instrumented before the targets import it)
    from pipeinfer_cli.runtime import tokenizer, vocab  # noqa: F401
    from pipeinfer_cli import native  # noqa: F401
    from pipeinfer_cli.models import gguf_info  # noqa: F401
    from pipeinfer_cli.planner import layout  # noqa: F401
    import llama_cpp.llama_chat_format  # noqa: F401

import mutator  # noqa: E402  (not instrumented: its own branches are not the target's coverage)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(targets.TARGETS)}}} [libFuzzer options] [CORPUS_DIR...]")
    target = sys.argv.pop(1)
    replay.limit_memory()

    def one_input(data: bytes) -> None:
        targets.run(target, data)

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        return mutator.mutate(data, max_size, seed, atheris.Mutate)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    atheris.Setup(sys.argv, one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

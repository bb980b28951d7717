"""Bad input at scale: `pipeinfer generate` driven with random option values and prompt text
(hypothesis), as real processes on SmolLM2.

Every run must end in one of two ways:
- success (exit 0): with --json, stdout is one complete JSON object;
- failure: exit status 1 or 2, exactly one `Error: ` line on stderr, no traceback, and with
  --json nothing on stdout (never half an object);
and never hang (a run has 600 s: SmolLM2 with -n <= 24 takes a few seconds alone, but a run took 3 minutes
of wall-clock time for 8 s of CPU on 2 cores shared by 20 busy processes).

`make test` runs a few derandomized examples (PIPEINFER_PROPERTY_EXAMPLES, default 10);
`make test-properties` runs 200 fresh ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MODEL = "smollm2-135m-instruct"
PIPEINFER = str(Path(sys.executable).parent / "pipeinfer")
EXAMPLES = int(os.environ.get("PIPEINFER_PROPERTY_EXAMPLES", "10"))
FRESH = os.environ.get("PIPEINFER_PROPERTY_FRESH", "") not in ("", "0")

# Text an argv can hold: no NUL, no lone surrogates.
argv_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=40)
odd_numbers = st.sampled_from(["nan", "inf", "-inf", "1e400", "-0", "", " 3", "0x10", "1_000", "3.5", "abc",
                               str(2**63), str(-(2**63) - 1), str(2**70)])


def number(ints: st.SearchStrategy) -> st.SearchStrategy:
    """An option value: usually a number in a plausible range, sometimes a malformed one."""
    return st.one_of(ints.map(str), odd_numbers)


OPTIONS = {
    "-n": number(st.integers(-3, 24)),
    "--temp": number(st.floats(-1, 3, allow_nan=False).map(lambda x: round(x, 3))),
    "--top-k": number(st.integers(-2, 100)),
    "--top-p": number(st.floats(-0.5, 1.5).map(lambda x: round(x, 3))),
    "--min-p": number(st.floats(-0.5, 1.5).map(lambda x: round(x, 3))),
    "--seed": number(st.integers(-(2**66), 2**66)),
    "--n-draft": number(st.integers(-1, 80)),
    "--p-accept": number(st.floats(-0.5, 1.5).map(lambda x: round(x, 3))),
    "--p-split": number(st.floats(-0.5, 1.5).map(lambda x: round(x, 3))),
    "--max-branches": number(st.integers(-1, 10)),
    "--max-inflight": number(st.integers(-1, 40)),
    "--ctx": number(st.integers(-5, 5000)),
    "--threads": st.one_of(st.sampled_from(["1", "2", "1,1", "0", "-1", "x", "1,2,3", ""]), argv_text),
    "--ranks": st.sampled_from(["1", "1", "1", "2", "0", "-1", "x", "99"]),
    "--layer-split": st.one_of(st.sampled_from(["1", "0.5,0.5", "1/1", "0,1", "nan", "1,", "/1", "-1,2"]), argv_text),
    "--mode": st.one_of(st.sampled_from(["iterative", "speculative", "pipeinfer"]), argv_text),
    "--draft": st.one_of(st.sampled_from(["lookup", "lookup", MODEL, "no-such-model", "/nonexistent.gguf"]), argv_text),
    "--stop": argv_text,
    "--system": argv_text,
}
messages_json = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", ""]),
                                    "content": st.one_of(argv_text, st.integers(), st.none())}), max_size=3)
    .map(json.dumps),
    st.sampled_from(["", "[", "{}", "null", "[1]", '[{"role": "user"}]', '"hi"']),
)


@st.composite
def generate_args(draw):
    """(argv after `generate MODEL`, a file's bytes or None, stdin bytes or None, --json?)."""
    args: list[str] = []
    file_bytes = stdin = None
    source = draw(st.sampled_from(["-p", "--chat", "-f", "-f -", "--messages", "none", "two"]))
    if source in ("-p", "--chat"):
        args += [source, draw(argv_text)]
    elif source == "-f":
        file_bytes = draw(st.one_of(argv_text.map(str.encode), st.binary(max_size=40)))
        args += ["-f", "{file}"]
    elif source == "-f -":
        stdin = draw(st.one_of(argv_text.map(str.encode), st.binary(max_size=40)))
        args += ["-f", "-"]
    elif source == "--messages":
        file_bytes = draw(messages_json).encode()
        args += ["--messages", "{file}"]
    elif source == "two":
        args += ["-p", "a", "--chat", "b"]
    for opt in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4, unique=True)):
        args += [opt, draw(OPTIONS[opt])]
    if "-n" not in args:
        args += ["-n", "8"]  # keep successful runs short
    as_json = draw(st.booleans())
    if as_json:
        args.append("--json")
    return args, file_bytes, stdin, as_json


def run_generate(args: list[str], file_bytes: bytes | None, stdin: bytes | None, tmp: Path):
    path = tmp / "prompt.txt"
    if file_bytes is not None:
        path.write_bytes(file_bytes)
    argv = [PIPEINFER, "generate", MODEL, *(str(path) if a == "{file}" else a for a in args)]
    env = {**os.environ, "PIPEINFER_DEBUG": ""}
    return subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=600, env=env)


def check_outcome(proc, as_json: bool) -> None:
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    context = f"exit {proc.returncode}\nstdout: {out[-2000:]!r}\nstderr: {err[-3000:]!r}"
    assert "Traceback" not in err, context
    if proc.returncode == 0:
        assert "Error:" not in err, context
        if as_json:
            json.loads(out)  # one complete object
        return
    assert proc.returncode in (1, 2), context
    error_lines = [ln for ln in err.splitlines() if ln.startswith("Error: ")]
    assert len(error_lines) == 1, context
    if as_json:
        assert out == "", context


@pytest.mark.mpi
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not FRESH, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(case=generate_args())
@example(case=(["-p", "Hello", "-n", "4", "--json"], None, None, True))
def test_generate_ends_in_success_or_one_error_line(smollm2_path, tmp_path, case):
    args, file_bytes, stdin, as_json = case
    check_outcome(run_generate(args, file_bytes, stdin, tmp_path), as_json)

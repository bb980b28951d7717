"""The commands in README.md and docs/*.md run as written.

Every line of a ```bash, ```sh or ```console block that calls `pipeinfer` (by name or by a path
ending in /pipeinfer, also after a launcher, an environment assignment or a pipe) must name an
existing command and only options that command has, with a value after each option that takes one;
the command line then passes the CLI's own parser (`--help` appended, so nothing runs).

The blocks right below a `<!-- docs-test: run -->` line (invisible on GitHub) are run for real,
through bash from a temporary directory, with `.venv/bin` first on the PATH: they must need no
cluster, no server and no model but SmolLM2, and each must succeed and print what it promises.
Relative links between the pages must lead to a file, and to a heading when they name one.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from jobprocs import assert_no_survivors, job_env
from pipeinfer_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
RUN_MARKER = "<!-- docs-test: run -->"
BIN = Path(sys.executable).parent  # .venv/bin: the pipeinfer the examples call
RUN_TIMEOUT_S = 120  # each takes 0.3-7 s on a quiet 2-core machine; much longer beside other jobs

CLI = typer.main.get_command(app)
runner = CliRunner()

# A word that is an option's value, not a command, even when it is spelled "pipeinfer".
_VALUE_OPTIONS = {"--mode", "-M"}
_SHELL_OPERATORS = set("|&;<>()")
_NUMBER = re.compile(r"^-\d+(\.\d+)?$")


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository root
    line: int  # of the command's first line in the page
    text: str  # continuation lines joined
    run: bool  # in a block marked to be run

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _commands(block: list[tuple[int, str]], console: bool) -> list[tuple[int, str]]:
    """The block's command lines, `\\` continuations joined; in a console block, the `$ ` lines."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in block:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
            pending = None
        elif console:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1].rstrip())
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            out.append((number, line.strip()))
    assert pending is None, f"a command ends with a continuation backslash at line {pending[0]}"
    return out


def extract(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    found: list[Example] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        lang = fence.group(1).lower()
        marked = i > 0 and lines[i - 1].strip() == RUN_MARKER
        block = []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            block.append((i + 1, lines[i]))
            i += 1
        i += 1  # the closing fence
        assert not marked or lang in SHELL_LANGS, f"{page}: {RUN_MARKER} above a ```{lang} block"
        if lang in SHELL_LANGS:
            found += [Example(page, n, text, marked) for n, text in _commands(block, lang == "console")]
    return found


def _words(command: str) -> list[str]:
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def invocations(command: str) -> list[list[str]]:
    """The argument lists of every pipeinfer invocation in a shell line (`generate …`, `models list`)."""
    words = _words(command)
    found = []
    k = 0
    while k < len(words):
        w = words[k]
        if (w == "pipeinfer" or w.endswith("/pipeinfer")) and (k == 0 or words[k - 1] not in _VALUE_OPTIONS):
            end = k + 1
            while end < len(words) and not set(words[end]) <= _SHELL_OPERATORS:
                end += 1
            found.append(words[k + 1:end])
            k = end
        elif w.endswith("emulate-cluster.sh") and words[k + 1:k + 2] == ["run"] and "--" in words[k:]:
            # `emulate-cluster.sh run N [--rate R] -- ARGS` runs `pipeinfer generate --ranks N ARGS`
            start = words.index("--", k) + 1
            end = start
            while end < len(words) and not set(words[end]) <= _SHELL_OPERATORS:
                end += 1
            found.append(["generate", *words[start:end]])
            k = end
        else:
            k += 1
    return found


def check_invocation(args: list[str]) -> list[str]:
    """What is wrong with `pipeinfer ARGS` (empty: nothing): the command, its options and values, its
    positional arguments."""
    if not args or args[0].startswith("-"):
        return [] if args and args[0] in ("--help", "--version", "-V") else ["no command after pipeinfer"]
    cmd, path, rest = CLI, [], list(args)
    while hasattr(cmd, "commands"):  # a group: `models list`
        if not rest or rest[0] not in cmd.commands:
            return [f"{' '.join(['pipeinfer', *path, *rest[:1]])!r}: no such command "
                    f"(known: {', '.join(sorted(cmd.commands))})"]
        path.append(rest[0])
        cmd = cmd.commands[rest.pop(0)]
    options = {name: p for p in cmd.params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")}
    arguments = [p for p in cmd.params if p.param_type_name == "argument"]
    room = sum(float("inf") if p.nargs == -1 else p.nargs for p in arguments)
    where = "pipeinfer " + " ".join(path)
    problems, positional, i = [], 0, 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("-") and word != "-" and not _NUMBER.match(word):
            name, eq, _ = word.partition("=")
            param = options.get(name)
            if name == "--help":
                pass
            elif param is None:
                problems.append(f"{where}: no option {name}")
            elif not param.is_flag and not eq:
                if i + 1 == len(rest):
                    problems.append(f"{where}: {name} needs a value")
                i += 1  # its value, whatever it looks like (`-n -1`)
        else:
            positional += 1
        i += 1
    if positional > room:
        problems.append(f"{where}: {positional} positional arguments, at most {room} allowed")
    return problems


EXAMPLES = [e for page in PAGES for e in extract(page)]
CALLS = [(e, args) for e in EXAMPLES for args in invocations(e.text)]


def test_examples_are_found():
    """The extraction itself works: the pages hold many pipeinfer command lines, of every command,
    and a handful marked to be run."""
    assert len(CALLS) >= 40, [str(e) for e, _ in CALLS]
    assert {"generate", "chat", "serve", "bench", "inspect", "models"} <= {args[0] for _, args in CALLS}
    assert sum(1 for e in EXAMPLES if e.run) >= 5
    # shapes the extraction must handle
    texts = [e.text for e, _ in CALLS]
    assert any("\\" not in t and "--json bench.json" in t and "--plot bench.png" in t for t in texts)  # joined
    assert any(t.startswith(".venv/bin/mpiexec") for t in texts)  # a launcher before a path to pipeinfer
    assert any("emulate-cluster.sh run" in t for t in texts)


def test_checker_catches_what_it_should():
    """The checks fail where a user's copy would fail."""
    ok = ["generate", "smollm2-135m-instruct", "-p", "Hi", "-n", "-1", "--stop", " 10,", "--no-pull", "--json"]
    assert check_invocation(ok) == []
    assert check_invocation(["models", "pull", "a", "b"]) == []
    assert check_invocation(["serve", "m", "--no-prefix-reuse", "--port", "8081"]) == []
    assert "pipeinfer generate: no option --n-predicts" in check_invocation(["generate", "m", "--n-predicts", "4"])
    assert check_invocation(["chat", "m", "--json"]) == ["pipeinfer chat: no option --json"]
    assert check_invocation(["generate", "m", "-p"]) == ["pipeinfer generate: -p needs a value"]
    assert check_invocation(["generate", "m", "extra"]) == ["pipeinfer generate: 2 positional arguments, at most 1 allowed"]
    assert check_invocation(["models", "fetch", "m"])[0].startswith("'pipeinfer models fetch': no such command")
    assert check_invocation(["run", "m"])[0].startswith("'pipeinfer run': no such command")
    assert invocations('a | pipeinfer generate m --mode pipeinfer -p "x # y" > out.txt   # note') == [
        ["generate", "m", "--mode", "pipeinfer", "-p", "x # y"]]
    assert invocations("scripts/emulate-cluster.sh run 3 --rate 1gbit -- m -n 4") == [["generate", "m", "-n", "4"]]
    block = [(1, "pipeinfer generate m \\"), (2, "    --json  # one object"), (3, "# a comment"), (4, "make test")]
    assert _commands(block, console=False) == [(1, "pipeinfer generate m --json  # one object"), (4, "make test")]
    assert _commands([(1, "$ pipeinfer models list"), (2, "smollm2 llama")], console=True) == [
        (1, "pipeinfer models list")]


@pytest.mark.parametrize("example,args", CALLS, ids=[f"{e.page}:{e.line}" for e, _ in CALLS])
def test_command_line_parses(example, args):
    problems = check_invocation(args)
    assert not problems, f"{example}\n" + "\n".join(problems)
    # and the CLI's own parser agrees (--help: parsed, nothing run)
    r = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, f"{example}\n{r.output}"


# --- the examples that are run -------------------------------------------------------------------

RUN = [e for e in EXAMPLES if e.run]
# What a marked example must not need: another model, a launcher, a cluster, root, a server, a download.
_NOT_RUNNABLE = re.compile(r"qwen|gemma|mpirun|mpiexec|srun|sbatch|emulate-cluster|sudo|hosts?\b|"
                           r"\bserve\b|models pull|curl|\.gguf")


def test_marked_examples_need_no_cluster():
    for e in RUN:
        assert invocations(e.text), f"{e}: a marked block holds a line that does not call pipeinfer"
        assert not _NOT_RUNNABLE.search(e.text), f"{e}: needs more than this machine and SmolLM2; do not mark it"


def _expectations(args: list[str]) -> list[tuple[str, str]]:
    """(stream, pattern) the run must print, from what the command promises."""
    if args[0] in ("generate", "chat"):
        return [("stderr", r"pipeinfer: [1-9]\d* tokens?, .*tok/s")]  # the summary line, tokens generated
    if args[0] == "bench":
        return [("stdout", r"iterative"), ("stdout", r"\bsame\b")]  # the table, every mode's tokens equal
    if args[:2] == ["models", "list"]:
        return [("stdout", r"smollm2-135m-instruct\s+llama\s+\d+\s+yes")]
    if args[:2] == ["models", "path"]:
        return [("stdout", r"\.gguf\s*$")]
    if args[0] == "inspect":
        return [("stdout", r"layer split for \d+ ranks?")]
    raise AssertionError(f"no expectation for `pipeinfer {' '.join(args)}`: add one")


@pytest.fixture(scope="module")
def examples_cache(smollm2_path, tmp_path_factory) -> Path:
    """A model cache holding SmolLM2 only, shared by the examples of this module: an example that
    calibrates (`-M auto` on several ranks) keeps its profile here, never in the user's cache."""
    cache = tmp_path_factory.mktemp("examples-cache")
    (cache / smollm2_path.name).symlink_to(smollm2_path)
    return cache


@pytest.mark.mpi
@pytest.mark.parametrize("example", RUN, ids=[f"{e.page}:{e.line}" for e in RUN])
def test_marked_example_runs(example, examples_cache, tmp_path):
    marker = uuid.uuid4().hex
    # passive OpenMP waits: a rank alone on its host spins by default, which crawls beside other jobs
    env = job_env(marker, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PIPEINFER_NO_PULL="1",
                  PIPEINFER_CACHE=str(examples_cache), OMP_WAIT_POLICY="passive")
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", example.text], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{example}\ndid not end within {RUN_TIMEOUT_S} s")
    finally:
        assert_no_survivors(marker)
    report = f"{example}\nexit status {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert proc.returncode == 0, report
    assert "Error:" not in err and "Traceback" not in err, report
    # a redirected stdout (`> answers.txt`) is checked in the file it went to
    redirect = re.search(r">\s*(\S+)\s*$", example.text.split("#")[0].strip())
    if redirect:
        out = (tmp_path / redirect.group(1)).read_text()
        assert out.strip(), f"{report}\n{redirect.group(1)} is empty"
    for args in invocations(example.text):
        for stream, pattern in _expectations(args):
            assert re.search(pattern, {"stdout": out, "stderr": err}[stream], re.M), f"{report}\nno /{pattern}/ in {stream}"


# --- links -----------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            base, n = slug, 1
            while slug in anchors:
                slug, n = f"{base}-{n}", n + 1
            anchors.add(slug)
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # nor code spans
    return _LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_anchor_slugs():
    page = ROOT / "docs" / "chat.md"
    assert "prefix-reuse" in _anchors(page)
    assert "hung-ranks---rank-timeout" in _anchors(ROOT / "docs" / "faults.md")

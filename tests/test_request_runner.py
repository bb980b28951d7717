"""The one request runner (decode/request.py): what it does on a virtual pipeline, and a scan that
keeps prefill and the mode dispatch from being called anywhere else in the package."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import numpy as np
import pytest

from pipeinfer_cli.decode.drafters import Proposal
from pipeinfer_cli.decode.modes import MODE_NAMES
from pipeinfer_cli.decode.request import DraftSite, Streaming, run_request
from pipeinfer_cli.decode.sampling import SamplingParams
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.decode.text_stream import TextStream
from pipeinfer_cli.decode.trace import TraceRecorder
from pipeinfer_cli.decode.virtual_pipeline import VirtualPipeline

SRC = Path(__file__).resolve().parent.parent / "src" / "pipeinfer_cli"
V = 40
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def target_logits(ctx: tuple[int, ...]) -> np.ndarray:
    """A fake target whose greedy token is a function of the last two tokens (so lookups match)."""
    logits = np.zeros(V, np.float32)
    logits[(ctx[-1] * 7 + (ctx[-2] if len(ctx) > 1 else 0)) % V] = 5.0
    return logits


def greedy(ctx: list[int]) -> int:
    return int(np.argmax(target_logits(tuple(ctx))))


class Oracle:
    """Proposes the target's greedy continuation, wrong at every fifth position; records when it
    read the prompt (`start`), in which thread, and its probes (`read_context`)."""

    name = "oracle"

    def __init__(self, pipe: VirtualPipeline, has_prompt_pass: bool = True):
        self.pipe, self.has_prompt_pass = pipe, has_prompt_pass
        self.events: list[tuple[str, int]] = []  # (what, launches so far)
        self.start_threads: list[str] = []

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        self.events.append(("start", len(self.pipe.ops("launch"))))
        self.start_threads.append(threading.current_thread().name)

    def read_context(self, tokens: list[int]) -> None:
        self.events.append(("read_context", len(self.pipe.ops("launch"))))

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        out, ctx = Proposal([], [], []), list(path)
        while len(out.tokens) < n_max:
            tok = (greedy(ctx) + (len(ctx) % 5 == 0)) % V
            out.tokens.append(tok)
            out.probs.append(0.9)
            out.alternatives.append([])
            ctx.append(tok)
        return out

    def close(self) -> None:
        pass


def run(mode: str, latency: int = 0, site: DraftSite = DraftSite(), has_prompt_pass: bool = True, n: int = 30,
        **kw):
    pipe = VirtualPipeline(target_logits, latency, n_seq_max=12)
    drafter = Oracle(pipe, has_prompt_pass)
    s = run_request(pipe, mode, PROMPT, DecodeOptions(n_predict=n, max_inflight=3), drafter,
                    sampling=SamplingParams(), n_predict=n, is_eog=lambda t: False, site=site, **kw)
    return s, drafter, pipe


def reference(n: int) -> list[int]:
    toks = list(PROMPT)
    while len(toks) < len(PROMPT) + n:
        toks.append(greedy(toks))
    return toks[len(PROMPT):]


@pytest.mark.parametrize("latency", [0, 3])
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_every_mode_through_the_runner_gives_the_targets_tokens(mode, latency):
    s, _, _ = run(mode, latency)
    assert s.generated == reference(30) and s.finish_reason == "length"
    if mode != "iterative":
        assert s.metrics.acceptance.drafted > 0  # it did speculate


def test_an_on_head_draft_is_traced_and_reads_the_prompt_in_a_thread_beside_the_stages():
    trace = TraceRecorder(0)
    _, drafter, _ = run("speculative", latency=2, site=DraftSite(on_head=True, threaded=True, trace=trace))
    slices = [e for e in trace.events if e[0] == "X" and e[1] == "draft"]
    assert slices[0][4] == {"n_tokens": len(PROMPT), "prefill": True}
    assert len(slices) > 1  # and each proposal
    assert drafter.start_threads[0] != threading.current_thread().name

    trace = TraceRecorder(0)  # a draft rank traces its own work; virtual time runs the pass inline
    _, drafter, _ = run("speculative", latency=2, site=DraftSite(on_head=False, threaded=False, trace=trace))
    assert not trace.events
    assert drafter.start_threads == [threading.current_thread().name]


def test_on_one_stage_the_prompt_pass_of_an_on_head_draft_waits_for_a_probe():
    _, drafter, _ = run("pipeinfer", site=DraftSite(on_head=True))
    assert drafter.events[0][0] == "read_context"  # a probe first; the prompt pass after it, if ever
    for site, prompt_pass in ((DraftSite(on_head=False), True), (DraftSite(on_head=True), False)):
        _, drafter, _ = run("pipeinfer", site=site, has_prompt_pass=prompt_pass)
        assert drafter.events[0] == ("start", 1)  # right after the prompt's one chunk


def test_the_caller_sees_tokens_text_and_may_cancel():
    seen, shown = [], []
    text = TextStream(lambda t: f"<{t}>".encode())
    s, _, _ = run("pipeinfer", latency=2, streaming=Streaming(seen.append, text, shown.append), clock=lambda: 5.0)
    assert seen == s.generated and "".join(shown) == text.text == "".join(f"<{t}>" for t in s.generated)
    assert s.metrics.t_start == 5.0  # the session keeps the caller's clock (virtual time in the planner)

    s, _, _ = run("pipeinfer", latency=2, streaming=Streaming(cancelled=lambda: True))
    assert s.finish_reason == "cancelled" and s.generated == reference(30)[:len(s.generated)]


# -- the scan: prefill and the decode loops have one caller each --------------------------------------------

# entry point -> the one module (relative to the package) that may use it
ENTRY_OWNERS = {"prefill": "decode/request.py", "decode": "decode/request.py",
                "decode_iterative": "decode/modes.py", "decode_speculative": "decode/modes.py",
                "decode_pipeinfer": "decode/modes.py"}
ENTRY_MODULES = {"sync", "modes", "pipeinfer"}  # where they are defined (decode/sync.py, modes.py, pipeinfer.py)


def _entry_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, entry point) for every import of an entry point from its module, and every call of
    one through the module (`sync.prefill(...)`)."""
    uses, module_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = (node.module or "").rsplit(".", 1)[-1]
            for alias in node.names:
                if source in ENTRY_MODULES and alias.name in ENTRY_OWNERS:
                    uses.append((node.lineno, alias.name))
                elif alias.name in ENTRY_MODULES:
                    module_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            module_names |= {a.asname or a.name for a in node.names if a.name.rsplit(".", 1)[-1] in ENTRY_MODULES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ENTRY_OWNERS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in module_names:
            uses.append((node.lineno, node.func.attr))
    return uses


def test_the_scan_finds_every_way_in():
    code = ("from ..decode.sync import prefill\nfrom .modes import decode as run_mode\n"
            "from ..decode import sync\nsync.prefill(p, s)\nimport pipeinfer_cli.decode.pipeinfer as pi\n"
            "pi.decode_pipeinfer(p, s)\nfrom .sync import Session\nb.decode('utf-8')\nfrom .modes import needs_draft\n")
    assert _entry_uses(ast.parse(code)) == [(1, "prefill"), (2, "decode"), (4, "prefill"), (6, "decode_pipeinfer")]


def test_prefill_and_the_decode_loops_are_driven_by_the_request_runner_only():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for line, name in _entry_uses(ast.parse(path.read_text(), str(path))):
            if ENTRY_OWNERS[name] != rel:
                found.append(f"{rel}:{line} ({name})")
    assert not found, ("a request's prefill or decode loop driven outside decode/request.py (run a request with "
                       "decode.request.run_request): " + ", ".join(found))

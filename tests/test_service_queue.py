"""The service's queue on its own (no MPI, no HTTP): admission, FIFO order, cancellation, stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeinfer_cli.decode.draft_spec import DraftSpec
from pipeinfer_cli.decode.metrics import Acceptance, RunCounters
from pipeinfer_cli.decode.result import GenerationResult
from pipeinfer_cli.runtime.job import JobConfig
from pipeinfer_cli.runtime.service import (
    GenerationRequest, InvalidRequest, RequestTooLong, Service, ServiceUnavailable,
)


def ready_service(max_queue: int, n_ctx: int = 64) -> Service:
    svc = Service(max_queue=max_queue)
    svc.attach(JobConfig(Path("target.gguf"), "target", None, DraftSpec.lookup(), n_ctx=n_ctx), None)
    svc.callbacks().on_start(None)  # what head.serve_requests calls once the models are loaded
    return svc


def test_not_ready_while_loading():
    with pytest.raises(ServiceUnavailable) as e:
        Service().submit(GenerationRequest([1, 2]), print)
    assert e.value.reason == "loading" and e.value.retry_after


def test_admission_fifo_cancel_and_stop():
    svc = ready_service(max_queue=2)
    events = {i: [] for i in range(1, 5)}
    tickets = [svc.submit(GenerationRequest([1, 2, 3], n_predict=4), events[i].append) for i in (1, 2, 3)]
    # One may generate and two wait, whether or not the pipeline has taken the first one yet.
    with pytest.raises(ServiceUnavailable) as e:
        svc.submit(GenerationRequest([1], n_predict=4), events[4].append)
    assert e.value.reason == "queue_full" and e.value.retry_after == 1
    gen = svc.requests()
    req, prompt = next(gen)
    assert req.label == "1" and prompt == [1, 2, 3] and req.n_predict == 4 and req.mode == "pipeinfer"
    assert not req.cancelled()
    assert svc.queue_depth() == 2 and svc.busy()
    tickets[1].cancel()  # its client went away while it waited: it is skipped
    svc.callbacks().on_result(GenerationResult(
        prompt_id="1", mode="pipeinfer", model="m", draft=None, layer_split="1", n_ctx=64, text="", tokens=[],
        finish_reason="cancelled", n_prompt=3, n_gen=0, ttft_s=None, tok_per_s=None, decode_tok_per_s=None,
        itl_ms=None, acceptance=Acceptance(), runs=RunCounters(), wire={}, t_start=0.0, t_end=0.0, ranks=[]))
    req, _ = next(gen)
    assert req.label == "3" and [e.kind for e in events[2]] == ["error"] and events[2][0].reason == "cancelled"
    assert [e.kind for e in events[1]] == ["done"] and events[1][0].result.run_index == 0
    svc.stop("going away")
    assert req.cancelled()  # the running request ends at its next commit
    assert [(e.kind, e.text) for e in events[3]] == [("error", "going away")]
    with pytest.raises(StopIteration):
        next(gen)
    with pytest.raises(ServiceUnavailable):
        svc.submit(GenerationRequest([1], n_predict=4), print)


def test_requests_that_cannot_run_are_refused_with_the_field():
    svc = ready_service(max_queue=1, n_ctx=64)
    with pytest.raises(InvalidRequest) as e:
        svc.check(GenerationRequest([1], mode="turbo"))
    assert e.value.field == "mode"
    with pytest.raises(InvalidRequest) as e:
        svc.check(GenerationRequest([]))
    assert e.value.field == "prompt"
    with pytest.raises(RequestTooLong) as e:
        svc.check(GenerationRequest([1] * 10, mode="iterative", n_predict=60))
    assert e.value.field == "n_predict" and "at most 53" in str(e.value)
    with pytest.raises(RequestTooLong) as e:
        svc.check(GenerationRequest([1] * 70, mode="iterative", n_predict=1))
    assert e.value.field == "prompt"
    svc.check(GenerationRequest([1] * 10, mode="iterative", n_predict=53))  # exactly fits


def test_parallel_slots_admission_and_the_slot_context():
    """--parallel 2 --queue 1: two generate and one waits; a request is checked against its slot's
    share of --ctx (in whole 256-cell blocks)."""
    svc = Service(max_queue=1, parallel=2)
    cfg = JobConfig(Path("target.gguf"), "target", None, DraftSpec.lookup(), n_ctx=1100, parallel=2)
    assert cfg.slot_ctx == 512 and cfg.engine_ctx == 1024
    svc.attach(cfg, None)
    svc.callbacks().on_start(None)
    events = {i: [] for i in range(4)}
    for i in range(3):
        svc.submit(GenerationRequest([1, 2, 3], n_predict=4), events[i].append)
    with pytest.raises(ServiceUnavailable, match=r"2 requests \(--parallel\) generating, 1 waiting"):
        svc.submit(GenerationRequest([1], n_predict=4), events[3].append)
    first, second = svc.take_parallel(0.1), svc.take_parallel(0.1)
    assert (first.seq, second.seq) == (1, 2) and svc.n_running() == 2 and svc.queue_depth() == 1
    svc.release(first)
    assert svc.n_running() == 1
    with pytest.raises(RequestTooLong, match=r"a slot's context of 512 cells \(--ctx 1100 / --parallel 2\)"):
        svc.check(GenerationRequest([1] * 10, n_predict=600))
    svc.stop("going away")  # the running and the waiting requests get their error
    assert [e.kind for e in events[1]] == ["error"] and [e.kind for e in events[2]] == ["error"]
    assert svc.take_parallel(0.1) is None

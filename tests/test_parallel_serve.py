"""`pipeinfer serve --parallel N`: several requests in the pipeline at once.

Every request gets exactly the tokens it gets alone, in every mode, on 2 and 3 ranks, with clients
of the official `openai` package at once (streamed and not); a disconnect cancels only its own
request; a short request beside a long one is not held back by it; a rank failure ends every
request in flight. The engine's KV slots and the load policy are tested on their own first.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import openai
import pytest

from jobprocs import rank_process, zombie_children
from serving import read_events, start_server

from pipeinfer_cli.decode.parallel_policy import SlotTable, may_speculate
from pipeinfer_cli.native import KVCacheFullError, LayerEngine

MODES = ["iterative", "speculative", "pipeinfer"]
PROMPTS = ["Write a haiku about the sea.", "List three primary colors.", "Say hello in French.",
           "What is 2 + 2? Explain."]
N = 20
COUNT = "1, 2, 3,"  # counts on and on: a generation that does not end by itself


# -- the engine's KV slots -----------------------------------------------------------------------
def _prefill_and_decode(eng, prompt, seq, n):
    """Logits of a 2-chunk prefill and n greedy decode steps in sequence `seq`."""
    out = []
    for b in range(0, len(prompt), 256):
        chunk = prompt[b:b + 256]
        logits = eng.eval(tokens=chunk, pos=list(range(b, b + len(chunk))), seq_ids=[[seq]] * len(chunk),
                          output=[False] * (len(chunk) - 1) + [True])
    out.append(logits[-1].copy())
    pos = len(prompt)
    for _ in range(n):
        tok = int(out[-1].argmax())
        out.append(eng.eval(tokens=[tok], pos=[pos], seq_ids=[[seq]], output=[True], batch_invariant=True)[-1].copy())
        pos += 1
    return out


def test_a_request_in_a_slot_beside_another_computes_its_solo_logits_bit_for_bit(smollm2_path):
    rng = np.random.default_rng(3)
    a, b = list(rng.integers(100, 20000, 300)), list(rng.integers(100, 20000, 530))
    n_layer = LayerEngine(smollm2_path, 0, 1, n_ctx=256).n_layer
    solo = LayerEngine(smollm2_path, 0, n_layer, n_ctx=2048, n_seq_max=8)
    want = _prefill_and_decode(solo, b, 0, 6)
    shared = LayerEngine(smollm2_path, 0, n_layer, n_ctx=4096, n_seq_max=16, n_slots=2)
    assert shared.n_slots == 2
    _prefill_and_decode(shared, a, 0, 3)  # slot 0's cells first: slot 1's would sit elsewhere without slots
    got = _prefill_and_decode(shared, b, 8, 6)  # sequence 8 is slot 1's canonical sequence
    assert all(np.array_equal(x, y) for x, y in zip(want, got))


def test_slots_refuse_mixed_batches_and_copies_across_slots(smollm2_path):
    n_layer = LayerEngine(smollm2_path, 0, 1, n_ctx=256).n_layer
    eng = LayerEngine(smollm2_path, 0, n_layer, n_ctx=1024, n_seq_max=8, n_slots=2)
    with pytest.raises(ValueError, match="mixes sequences of KV slots 0 and 1"):
        eng.eval(tokens=[1, 2], pos=[0, 0], seq_ids=[[0], [4]])
    eng.eval(tokens=[1], pos=[0], seq_ids=[[0]])
    with pytest.raises(ValueError, match="crosses KV slots"):
        eng.seq_cp(0, 5)
    with pytest.raises(ValueError, match="n_slots"):
        LayerEngine(smollm2_path, 0, n_layer, n_ctx=1000, n_seq_max=8, n_slots=3)
    # A slot that is full says so, while the other slot still has room.
    small = LayerEngine(smollm2_path, 0, n_layer, n_ctx=512, n_seq_max=4, n_slots=2)
    small.eval(tokens=list(range(5, 261)), pos=list(range(256)), seq_ids=[[0]] * 256)
    with pytest.raises(KVCacheFullError, match=r"KV slot 0 of 2"):
        small.eval(tokens=[7], pos=[256], seq_ids=[[0]])
    small.eval(tokens=[7], pos=[0], seq_ids=[[2]])


# -- the policies ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, inflight, n_stages, want", [
    ("yield", [2], 2, True),  # alone: speculate as always
    ("yield", [1, 1], 2, False),  # two requests fill two stages
    ("yield", [0, 1], 2, False),  # the request about to launch counts as the run it needs
    ("yield", [1, 1], 3, True),  # a spare stage carries speculation
    ("yield", [2, 1], 3, False),
    ("round-robin", [3, 1], 2, True),
    ("no-spec", [1, 0], 4, False),
    ("no-spec", [1], 4, True),
])
def test_load_policy(policy, inflight, n_stages, want):
    assert may_speculate(policy, inflight, n_stages) is want


def test_slot_choice_prefers_the_reusable_prefix_then_the_least_recently_used():
    table = SlotTable(3)
    long_prompt = list(range(600))
    first = table.pick(long_prompt)
    first.prefix.after_request(long_prompt, long_prompt + [1, 2])
    table.release(first)
    second = table.pick([9, 9, 9])
    assert second.index != first.index  # nothing to reuse: an unused slot, not the one holding a prefix
    table.release(second)
    assert table.pick(long_prompt[:520] + [5]).index == first.index  # 512 tokens to reuse there
    assert table.pick([1]).index not in (first.index,) and table.n_idle == 1
    table.pick([2])
    assert table.pick([3]) is None


# -- a real server -----------------------------------------------------------------------------------
def _ask(server, prompt: str, mode: str, **extra) -> dict:
    status, body = server.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                             "max_tokens": N, "mode": mode, **extra})
    assert status == 200, body
    return body


async def _concurrent(server, prompts: list[str], mode: str, extra: dict) -> list[str]:
    """The prompts' texts, asked at once: even ones streamed, odd ones not."""
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(i: int, prompt: str) -> str:
        args = dict(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=N,
                    extra_body={"mode": mode}, **extra)
        if i % 2:
            r = await client.chat.completions.create(**args)
            return r.choices[0].message.content
        stream = await client.chat.completions.create(**args, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.close()


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def parallel_server(request, smollm2_path, tmp_path_factory):
    s = start_server(smollm2_path, "--ranks", request.param, "--threads", 1, "--ctx", 2048, "--draft", "lookup",
                     "--parallel", 3, "--no-prefix-reuse", log_dir=tmp_path_factory.mktemp("parallel"))
    yield s
    s.stop()


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_concurrent_clients_get_exactly_their_solo_tokens(parallel_server, mode):
    server = parallel_server
    seeded = {"temperature": 0.8, "seed": 11}
    alone = [_ask(server, p, mode)["choices"][0]["message"]["content"] for p in PROMPTS[:3]]
    alone_seeded = _ask(server, PROMPTS[3], mode, **seeded)["choices"][0]["message"]["content"]
    together = asyncio.run(_concurrent(server, PROMPTS[:3], mode, {}))
    assert together == alone
    # Four at once on three slots (one waits), one of them seeded beside greedy ones.
    together = asyncio.run(_concurrent(server, PROMPTS[:3], mode, {}))
    assert together == alone
    seeded_beside = asyncio.run(_concurrent(server, [PROMPTS[3]] * 2, mode, seeded))
    assert seeded_beside == [alone_seeded, alone_seeded]
    _, _, raw = server.request("GET", "/slots")
    slots = json.loads(raw)
    assert [s["id"] for s in slots] == [0, 1, 2] and not any(s["is_processing"] for s in slots)


@pytest.mark.mpi
def test_a_disconnect_cancels_only_its_request_and_the_cells_return_to_baseline(parallel_server):
    server = parallel_server
    baseline = _ask(server, PROMPTS[0], "pipeinfer")["pipeinfer"]
    conn, resp = server.open_stream("/v1/completions", {"prompt": COUNT, "max_tokens": 400, "mode": "pipeinfer"})
    read_events(resp, 3)
    other: dict = {}
    t = threading.Thread(target=lambda: other.update(_ask(server, PROMPTS[0], "pipeinfer")))
    t.start()
    read_events(resp, 3)
    conn.sock.shutdown(2)
    conn.close()
    t.join(300)
    assert other["pipeinfer"]["tokens"] == baseline["tokens"]
    after = _ask(server, PROMPTS[0], "pipeinfer")["pipeinfer"]
    # The same request alone leaves the same cells in use on every rank: nothing of the cancelled one stayed.
    assert after["tokens"] == baseline["tokens"] and after["kv_used_cells"] == baseline["kv_used_cells"]


@pytest.mark.mpi
def test_a_short_request_beside_long_ones_is_not_held_back(parallel_server):
    """The stated bound: while a request of n tokens runs beside others (here two long ones whose
    counting prompt lookup drafts very well), each other request commits at most 2n + 4 tokens,
    because under the `yield` policy nobody speculates while the requests fill the stages."""
    server = parallel_server
    streams = [server.open_stream("/v1/completions", {"prompt": COUNT, "max_tokens": 400, "mode": "pipeinfer"})
               for _ in range(2)]
    try:
        for _, resp in streams:
            read_events(resp, 2)
        before = _decoded(server)
        short = _ask(server, PROMPTS[2], "pipeinfer", max_tokens=8)
        after = _decoded(server)
    finally:
        for conn, _ in streams:
            conn.sock.shutdown(2)
            conn.close()
    n = short["usage"]["completion_tokens"]
    assert set(before) == set(after) and len(before) == 2
    assert all(after[slot] - before[slot] <= 2 * n + 4 for slot in before), (before, after, n)


def _decoded(server) -> dict[int, int]:
    """Tokens decoded so far, per busy slot."""
    _, _, raw = server.request("GET", "/slots")
    return {s["id"]: s["n_decoded"] for s in json.loads(raw) if s["is_processing"]}


@pytest.mark.mpi
def test_a_rank_failure_with_requests_in_flight_ends_every_request_and_the_server(smollm2_path, tmp_path):
    # Rank 1 raises on its 40th run, while two requests are generating. The split is given: the
    # default one of --parallel 2 may need a quick calibration, which the injected fault would end.
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 1024, "--parallel", 2,
                          "--layer-split", "0.5,0.5", log_dir=tmp_path, PIPEINFER_DEBUG_FAIL="1:40")
    try:
        results: list = [None, None]

        def ask(i: int) -> None:
            results[i] = server.post_json("/v1/completions", {"prompt": COUNT, "max_tokens": 200})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        rc = server.proc.wait(timeout=60)
    finally:
        server.stop()
    # The fault comes back in every job the front starts: after --max-restarts (3) restarts every
    # client is told, with the fault and the bound named.
    for status, body in results:
        msg = body["error"]["message"]
        assert status == 503 and "injected fault" in msg and "--max-restarts 3" in msg, body
    assert rc == 1
    log = server.stderr()
    assert "Error: rank 1: " in log and "injected fault" in log and "Traceback" not in log, log


@pytest.mark.mpi
@pytest.mark.parametrize("signum, how", [(9, "killed by SIGKILL"), (15, "killed by SIGTERM")], ids=["SIGKILL", "SIGTERM"])
def test_a_rank_killed_from_outside_gives_every_client_an_error(smollm2_path, tmp_path, signum, how):
    """Rank 1's process killed while a streamed, an unstreamed and a queued request are in flight, with
    no restart allowed (--max-restarts 0; test_serve_recovery.py has the restarts): each client reads an error (an `error` event then the end of the stream; a 503 JSON), the server
    exits non-zero well within the rank timeout, and nothing of the job is left."""
    import os
    import time

    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 1024, "--parallel", 2,
                          "--queue", 2, "--rank-timeout", 60, "--max-restarts", 0, log_dir=tmp_path)
    results: dict = {}
    try:
        conn, resp = server.open_stream("/v1/completions", {"prompt": COUNT, "max_tokens": 400})

        def ask(name: str) -> None:
            results[name] = server.post_json("/v1/completions", {"prompt": COUNT, "max_tokens": 400}, timeout=120)

        threads = [threading.Thread(target=ask, args=(name,)) for name in ("unstreamed", "queued")]
        threads[0].start()
        read_events(resp, 3)
        threads[1].start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both slots busy, the third request waiting
            _, _, raw = server.request("GET", "/metrics")
            gauges = dict(ln.split(" ", 1) for ln in raw.decode().splitlines() if ln and not ln.startswith("#"))
            if float(gauges["pipeinfer_queue_depth"]) == 1 and float(gauges["pipeinfer_requests_running"]) == 2:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the queued request never queued")
        assert zombie_children(server.marker) == []  # e.g. a start watchdog left unreaped under a rank
        killed_at = time.monotonic()
        os.kill(rank_process(server.marker, 1), signum)
        rest = read_events(resp)  # until the stream ends
        for t in threads:
            t.join(60)
        rc = server.proc.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        server.stop()
    assert rest and rest[-1] != "[DONE]", rest[-3:]
    last = json.loads(rest[-1])
    assert "error" in last, rest[-3:]
    error = last["error"]
    want = "rank 1 (stage 2 of 2, host "
    assert "--max-restarts 0" in error["message"] and want in error["message"] and how in error["message"], error
    for name in ("unstreamed", "queued"):
        status, body = results[name]
        assert status == 503 and want in body["error"]["message"] and how in body["error"]["message"], (name, body)
    assert rc == 1 and took < 30, (rc, took)  # the rank timeout is 60 s: this was noticed, not timed out
    errors = [ln for ln in server.stderr().splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and how in errors[0] and "Traceback" not in server.stderr(), server.stderr()


@pytest.mark.mpi
def test_slots_say_who_holds_the_draft_model_and_only_the_holder_drafts(smollm2_path, tmp_path):
    """The job's draft model drafts for one request at a time: the other request's row names the
    holder, and under round-robin (every request runs its mode as if alone) only the holder drafts."""
    import time

    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 2048, "--draft", smollm2_path,
                          "--parallel", 2, "--load-policy", "round-robin", log_dir=tmp_path)
    try:
        results: list = [None, None]

        def ask(i: int) -> None:
            results[i] = server.post_json("/v1/completions", {"prompt": COUNT, "max_tokens": 48, "mode": "pipeinfer"})

        first = threading.Thread(target=ask, args=(0,))
        first.start()
        deadline = time.monotonic() + 60
        while not any(s.get("draft") == "model" for s in json.loads(server.request("GET", "/slots")[2])):
            assert time.monotonic() < deadline, "the first request never took the draft model"
            time.sleep(0.05)
        second = threading.Thread(target=ask, args=(1,))
        second.start()
        rows = []
        while time.monotonic() < deadline and len([r for r in rows if r["is_processing"]]) < 2:
            rows = json.loads(server.request("GET", "/slots")[2])
            time.sleep(0.05)
        first.join(120)
        second.join(120)
    finally:
        server.stop()
    holder = next(r for r in rows if r.get("draft") == "model")
    other = next(r for r in rows if r is not holder)
    assert "draft_model_held_by" not in holder, holder
    assert other["draft"] == "none" and other["draft_model_held_by"] == {"slot": holder["id"], "id_task": holder["id_task"]}, rows
    (s0, b0), (s1, b1) = results
    assert s0 == 200 and s1 == 200
    assert b0["timings"]["draft_n"] > 0 and b1["timings"]["draft_n"] == 0, (b0["timings"], b1["timings"])

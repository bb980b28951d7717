"""`pipeinfer serve` end to end: one real server (mpiexec, 2 ranks, SmolLM2, prompt-lookup draft)
for the whole module, talked to with the official `openai` client and plain HTTP.

The reference answers come from `pipeinfer generate --json` on the same model, prompt, seed and
job options; every mode must give exactly those tokens (speculation is lossless).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import openai
import pytest

from pipeinfer_cli.decode.session import chunk_floor

from jobprocs import assert_no_survivors
from serving import read_events, run_generate, start_server

pytestmark = pytest.mark.mpi

MODES = ["iterative", "speculative", "pipeinfer"]
KEY = "test-key-123"
JOB = ["--ranks", 2, "--threads", 1, "--ctx", 1024, "--draft", "lookup"]
N = 24
CHAT = "Write a haiku about the sea."
RAW = "The three primary colors are"
SEEDED = {"temperature": 0.8, "seed": 7}
COUNT = "1, 2, 3,"  # counts on and on: a generation that does not end by itself


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    s = start_server(smollm2_path, *JOB, "--queue", 3, "-n", N, log_dir=tmp_path_factory.mktemp("serve"), api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """What `pipeinfer generate` prints: a greedy chat and a seeded raw prompt."""
    return {
        "chat": run_generate(smollm2_path, *JOB, "--chat", CHAT, "-n", N, "--mode", "pipeinfer"),
        "raw": run_generate(smollm2_path, *JOB, "-p", RAW, "-n", N, "--temp", 0.8, "--seed", 7, "--mode", "speculative"),
    }


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_startup_health_and_models(server):
    # Before "ok", /health can only have said "loading" (503); the banner names address and ranks.
    assert all(seen == (503, {"status": "loading"}) for seen in server.health_seen), server.health_seen
    log = server.stderr()
    assert f"http://127.0.0.1:{server.port}" in log and "2 ranks: 0 head" in log and "draft lookup" in log, log
    status, _, raw = server.request("GET", "/v1/models")
    roles = {m["meta"]["role"]: m["id"] for m in json.loads(raw)["data"]}
    assert status == 200 and roles["draft"] == "lookup" and roles["target"].endswith(".gguf")


def target_name(server) -> str:
    """The loaded target's name, as /v1/models lists it (here the .gguf path the server was given)."""
    _, _, raw = server.request("GET", "/v1/models")
    return next(m["id"] for m in json.loads(raw)["data"] if m["meta"]["role"] == "target")


@pytest.mark.parametrize("mode", MODES)
def test_chat_matches_generate(server, client, reference, mode):
    ref = reference["chat"]
    r = client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": CHAT}], max_tokens=N,
                                       extra_body={"mode": mode})
    # The response names the model that wrote it, not the one the client asked for (llama-server does so).
    assert r.model == target_name(server) != "gpt-4"
    assert r.choices[0].message.content == ref["text"]
    assert r.model_extra["pipeinfer"]["tokens"] == ref["tokens"]
    assert r.usage.prompt_tokens == ref["n_prompt"] and r.usage.completion_tokens == ref["n_gen"]
    assert r.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    t = r.model_extra["timings"]
    assert t["mode"] == mode and t["predicted_n"] == ref["n_gen"] and t["ttft_ms"] > 0
    assert t["runs_launched"] >= 1 and t["tok_per_s"] > 0
    if mode == "iterative":
        assert t["runs_speculative"] == 0 and t["draft_n"] == 0 and t["acceptance_rate"] is None


@pytest.mark.parametrize("mode", MODES)
def test_chat_stream_matches_generate(server, client, reference, mode):
    ref = reference["chat"]
    stream = client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": CHAT}], max_tokens=N,
                                            stream=True, stream_options={"include_usage": True}, extra_body={"mode": mode})
    text, last, usage = "", None, None
    for chunk in stream:
        assert chunk.model == target_name(server)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                last = chunk
        if chunk.usage:
            usage = chunk.usage
    assert text == ref["text"]
    assert last.model_extra["pipeinfer"]["tokens"] == ref["tokens"]
    assert last.model_extra["timings"]["mode"] == mode
    assert usage.completion_tokens == ref["n_gen"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_seeded_completion_matches_generate(server, client, reference, mode, stream):
    ref = reference["raw"]
    r = client.completions.create(model="smollm2", prompt=RAW, max_tokens=N, stream=stream, extra_body={"mode": mode},
                                  **SEEDED)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = chunks[-1].model_extra["pipeinfer"]["tokens"]
        models = {c.model for c in chunks}
    else:
        text, tokens, models = r.choices[0].text, r.model_extra["pipeinfer"]["tokens"], {r.model}
    assert text == ref["text"] and tokens == ref["tokens"]
    assert models == {target_name(server)}


def test_curl_style_stream_is_openai_sse(server, reference):
    """The raw stream: `data: {chunk}` lines, a first chunk with the role, then `data: [DONE]`."""
    c, resp = server.open_stream("/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT}], "max_tokens": N})
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = read_events(resp)
    c.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == reference["chat"]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def _chat(server, content: str = CHAT, **extra) -> tuple[int, dict, dict]:
    status, headers, raw = server.request("POST", "/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": content}], "max_tokens": N, **extra})
    return status, headers, json.loads(raw)


def _in_threads(fn, n: int, stagger_s: float = 0.0) -> list:
    """fn(i) in n threads started in order; their results in the same order."""
    out = [None] * n

    def run(i):
        out[i] = fn(i)

    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(600)
    return out


def test_two_concurrent_clients(server, reference):
    prompts = [(CHAT, {}), (None, SEEDED)]

    def ask(i):
        content, extra = prompts[i]
        if content is None:
            return server.post_json("/v1/completions", {"prompt": RAW, "max_tokens": N, **extra})
        return server.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": N})

    (s1, chat), (s2, raw) = _in_threads(ask, 2)
    assert s1 == 200 and chat["pipeinfer"]["tokens"] == reference["chat"]["tokens"]
    assert s2 == 200 and raw["pipeinfer"]["tokens"] == reference["raw"]["tokens"]


def test_queue_is_fifo_and_overflow_gets_503(server, reference):
    """One long request generating, five more arrive: --queue 3 of them wait and are answered in
    order once it ends; the other two get 503 with Retry-After at once."""
    conn, resp = server.open_stream("/v1/completions", {"prompt": COUNT, "max_tokens": 600})
    read_events(resp, 2)  # the blocker is generating
    answers = _in_threads(lambda i: _chat(server), 5, stagger_s=0.05)
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    conn.close()  # wait: the refused ones came back while the blocker still ran; end the blocker now
    assert len(refused) == 2 and len(ok) == 3, [a[0] for a in answers]
    for status, headers, body in refused:
        assert status == 503 and headers.get("retry-after", headers.get("Retry-After")) == "1"
        assert body["error"]["code"] == "queue_full" and "--queue 3" in body["error"]["message"]
    for _, _, body in ok:
        assert body["pipeinfer"]["tokens"] == reference["chat"]["tokens"]
    by_submission = sorted(ok, key=lambda a: a[2]["pipeinfer"]["request"])
    runs = [a[2]["pipeinfer"]["run_index"] for a in by_submission]
    assert runs == sorted(runs), "the queue is first in, first out"


def _metric(server, name: str, labels: str = "") -> float:
    _, _, raw = server.request("GET", "/metrics")
    for line in raw.decode().splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("mode", MODES)
def test_client_disconnect_cancels_and_leaves_the_pipeline_clean(server, reference, mode):
    baseline = server.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT}],
                                                         "max_tokens": N})[1]["pipeinfer"]
    cancelled0 = _metric(server, "pipeinfer_requests_total", '{endpoint="/v1/completions",outcome="cancelled"}')
    conn, resp = server.open_stream("/v1/completions", {"prompt": COUNT, "max_tokens": 600, "mode": mode})
    read_events(resp, 4)
    conn.sock.shutdown(2)
    conn.close()
    status, _, after = _chat(server)
    assert status == 200 and after["pipeinfer"]["tokens"] == reference["chat"]["tokens"]
    # The same request leaves the same cells in use on every rank: nothing of the cancelled one stayed.
    assert after["pipeinfer"]["kv_used_cells"] == baseline["kv_used_cells"]
    assert _metric(server, "pipeinfer_requests_total", '{endpoint="/v1/completions",outcome="cancelled"}') == cancelled0 + 1
    assert _metric(server, "pipeinfer_kv_cells_used", '{rank="1"}') == baseline["kv_used_cells"]["1"]


def test_client_disconnect_while_waiting_for_a_whole_answer(server, reference):
    cancelled0 = _metric(server, "pipeinfer_requests_total", '{endpoint="/v1/completions",outcome="cancelled"}')
    body = json.dumps({"prompt": COUNT, "max_tokens": 600}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        while _metric(server, "pipeinfer_requests_running") != 1:  # generating
            time.sleep(0.05)
    status, _, after = _chat(server)
    assert status == 200 and after["pipeinfer"]["tokens"] == reference["chat"]["tokens"]
    assert _metric(server, "pipeinfer_requests_total", '{endpoint="/v1/completions",outcome="cancelled"}') == cancelled0 + 1


BAD = {  # id: (path, body, status, param, code)
    "malformed-json": ("/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
    "not-an-object": ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    "too-big": ("/v1/completions", json.dumps({"prompt": "x" * (5 << 20)}).encode(), 413, None, "request_too_large"),
    "n>1": ("/v1/chat/completions", {"n": 2}, 400, "n", "unsupported_parameter"),
    "logprobs": ("/v1/chat/completions", {"logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    "tools": ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
              "unsupported_parameter"),
    "negative-max-tokens": ("/v1/chat/completions", {"max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    "max-tokens-beyond-ctx": ("/v1/chat/completions", {"max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    "unknown-mode": ("/v1/chat/completions", {"mode": "turbo"}, 400, "mode", "invalid_value"),
    "bad-type": ("/v1/chat/completions", {"temperature": "hot"}, 400, "temperature", "invalid_type"),
    "bool-max-tokens": ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, 400, "max_tokens", "invalid_type"),
    "no-messages": ("/v1/chat/completions", {"messages": None}, 400, "messages", "missing_required_parameter"),
    "tool-role": ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role",
                  "invalid_value"),
    "empty-prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    "prompt-beyond-ctx": ("/v1/completions", {"prompt": "hello " * 2000}, 400, "prompt", "context_length_exceeded"),
    "no-prompt": ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    "batch-prompt": ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    "token-out-of-vocab": ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", "invalid_value"),
    "stop-not-text": ("/v1/chat/completions", {"stop": 5}, 400, "stop", "invalid_type"),
    "no-such-endpoint": ("/v1/embeddings", {}, 404, None, "not_found"),
    "spec-n-max-zero": ("/v1/chat/completions", {"speculative.n_max": 0}, 400, "speculative.n_max", "invalid_value"),
    "spec-n-min-above-max": ("/v1/chat/completions", {"speculative": {"n_max": 2, "n_min": 3}}, 400, "speculative.n_min",
                             "invalid_value"),
    "spec-p-min-above-1": ("/v1/chat/completions", {"speculative.p_min": 1.5}, 400, "speculative.p_min", "invalid_value"),
    "spec-unknown-key": ("/v1/chat/completions", {"speculative.n_mx": 2}, 400, "speculative.n_mx", "unsupported_parameter"),
}


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_speculation_settings_per_request(server, reference, mode):
    """llama-server's speculative.n_max / n_min / p_min change how a request drafts, never its tokens."""
    body = {"prompt": RAW, "max_tokens": N, "mode": mode, **SEEDED}
    plain = server.post_json("/v1/completions", body)[1]
    one = server.post_json("/v1/completions", {**body, "speculative.n_max": 1})[1]
    none = server.post_json("/v1/completions", {**body, "speculative": {"n_max": 2, "n_min": 2, "p_min": 1.0}})[1]
    texts = {r["choices"][0]["text"] for r in (plain, one, none)}
    assert texts == {plain["choices"][0]["text"]} and plain["pipeinfer"]["tokens"] == one["pipeinfer"]["tokens"]
    t1, t0 = one["timings"], none["timings"]
    assert t1["draft_n"] <= t1["runs_speculative"]  # at most one drafted token per run
    # p_min 1.0 stops a draft after its first token (lookup is never that sure), and n_min 2 then drops it.
    assert t0["draft_n"] == 0 and t0["runs_speculative"] == 0
    assert plain["timings"]["draft_by_source"] == {}  # a single drafter: no per-source split


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, case):
    path, body, status, param, code = BAD[case]
    if isinstance(body, dict):
        base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} if "chat" in path else {}
        body = json.dumps({**base, **body}).encode()
    got, _, raw = server.request("POST", path, body)
    err = json.loads(raw)["error"]
    assert (got, err["param"], err["code"]) == (status, param, code), err
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param.split("[")[0] in err["message"]
    assert _chat(server, max_tokens=2)[0] == 200


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic dGVzdA=="])
def test_api_key_is_required(server, auth):
    headers = {"Authorization": auth} if auth else {}
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics")]:
        status, _, raw = server.request(method, path, {"messages": []} if method == "POST" else None, auth=False,
                                        headers=headers)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert server.request("GET", "/health", auth=False)[0] == 200  # health stays open, as with llama-server


def test_metrics_in_prometheus_format(server):
    _, headers, raw = server.request("GET", "/metrics")
    text = raw.decode()
    assert headers["content-type"].startswith("text/plain")
    for name in ("pipeinfer_requests_total", "pipeinfer_generated_tokens_total", "pipeinfer_draft_accepted_tokens_total",
                 "pipeinfer_runs_cancelled_total", "pipeinfer_queue_depth", "pipeinfer_time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert _metric(server, "pipeinfer_generated_tokens_total") >= N
    assert _metric(server, "pipeinfer_queue_depth") == 0


NOTES = " ".join(f"Note {i}: the {w} harbour keeps {i % 5 + 2} boats tied at dusk."
                 for i, w in enumerate(["quiet", "old", "north", "grey", "small", "busy"] * 5))


def test_second_chat_turn_reuses_the_first_turns_prefix(server, client, smollm2_path, tmp_path):
    first = [{"role": "system", "content": NOTES}, {"role": "user", "content": "How many boats does note 3 mention?"}]
    r1 = client.chat.completions.create(model="smollm2", messages=first, max_tokens=N)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And note 4?"}]
    r2 = client.chat.completions.create(model="smollm2", messages=second, max_tokens=N)
    t = r2.model_extra["timings"]
    # The first turn's prompt (over 256 tokens) is reused in whole prefill chunks (up to a chunk boundary).
    assert r1.usage.prompt_tokens > 256, r1.usage
    assert t["cache_n"] == t["reused_tokens"] and t["cache_n"] >= 256 and chunk_floor(t["cache_n"]) == t["cache_n"]
    assert t["cache_n"] <= t["common_prefix_tokens"] <= r1.usage.prompt_tokens + r1.usage.completion_tokens
    # ... and the answer is the one `generate` gives the whole conversation from empty caches.
    msgs = tmp_path / "second.json"
    msgs.write_text(json.dumps(second))
    ref = run_generate(smollm2_path, *JOB, "--messages", msgs, "-n", N, "--mode", "pipeinfer")
    assert ref.get("reused_tokens", 0) == 0
    assert r2.model_extra["pipeinfer"]["tokens"] == ref["tokens"]
    assert r2.choices[0].message.content == ref["text"]


# Last: it stops the module's server.
def test_sigterm_ends_every_rank_and_in_flight_requests_get_an_error(server):
    """Last: stops the module's server."""
    conn, resp = server.open_stream("/v1/completions", {"prompt": COUNT, "max_tokens": 600})
    read_events(resp, 2)
    server.proc.send_signal(signal.SIGTERM)
    rest = read_events(resp)
    conn.close()
    assert rest and json.loads(rest[-1])["error"]["code"] == "stopping", rest[-3:]
    # Being told to stop is how a server ends: no error, exit status 0 (as on one rank).
    assert server.proc.wait(timeout=10) == 0
    assert_no_survivors(server.marker, grace_s=10)
    log = server.stderr()
    assert "Traceback" not in log and "Error" not in log, log
    assert log.splitlines()[-1] == "pipeinfer serve: stopped by SIGTERM", log



def test_chat_with_a_model_without_a_template_is_worded_for_the_api(gemma3_path, tmp_path):
    """The tokenizer's typed error is rendered by the server in its own terms (no CLI flags)."""
    from serving import start_server

    server = start_server(gemma3_path, "--threads", 1, "--ctx", 256, log_dir=tmp_path)
    try:
        status, body = server.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "messages", body
        msg = body["error"]["message"]
        assert "no chat template" in msg and "/v1/completions" in msg and "--" not in msg, msg
        status, body = server.post_json("/v1/completions", {"prompt": "The sky is", "max_tokens": 4})
        assert status == 200, body
    finally:
        server.stop()

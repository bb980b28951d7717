"""benchmarks/rpc.py's pure parts: llama.cpp's layer placement, its output and timings, the
pipeinfer results it compares with. (The script itself needs root, an emulated cluster and
`make llama-rpc`; docs/emulated-cluster.md has the run.)"""

from __future__ import annotations

import json

import pytest

import benchmarks.rpc as b


def _placed(n_layer: int, ngl: int, ts: list[int]) -> list[int]:
    """llama.cpp's own rule (llama-model.cpp, load_tensors): layer il (n_layer = the output layer)
    goes to the CPU before i_gpu_start, else to the first device whose cumulative share exceeds
    (il - i_gpu_start) / ngl. Returns the device of each layer: -1 for the client's CPU."""
    import bisect

    total = sum(ts)
    splits, acc = [], 0.0
    for t in ts:
        acc += t
        splits.append(acc / total)
    start = max(n_layer + 1 - ngl, 0)
    return [-1 if il < start else bisect.bisect_right(splits, (il - start) / ngl) for il in range(n_layer + 1)]


@pytest.mark.parametrize("counts", [[14, 14], [17, 11], [10, 9, 9], [1, 27], [7, 7, 7, 7]])
def test_layer_placement_reproduces_the_counts(counts):
    ngl, ts = b.layer_placement(28, counts)
    devices = _placed(28, ngl, ts)
    got = [devices[:-1].count(k - 1) for k in range(len(counts))]
    assert got == counts
    assert devices[-1] == len(counts) - 2  # the output layer on the last RPC host, as pipeinfer's last stage


def test_layer_placement_refuses_counts_that_do_not_add_up():
    with pytest.raises(b.Failure):
        b.layer_placement(28, [14, 13])


def test_even_counts():
    assert b.even_counts(28, 3) == [10, 9, 9]
    assert sum(b.even_counts(24, 5)) == 24


def test_completion_text():
    assert b.completion_text("def f():\n    pass\n\n") == ("def f():\n    pass", False)
    assert b.completion_text("Hello. [end of text]\n\n\n") == ("Hello.", True)


def test_speculative_text_cuts_the_echoed_prompt_and_the_eog_token():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert b.speculative_text("\n\n" + prompt + "Hello!<|im_end|>\n\n", prompt) == ("Hello!", True)
    assert b.speculative_text("\n\n" + prompt + "Hello\n\n", prompt) == ("Hello", False)
    with pytest.raises(b.Failure):
        b.speculative_text("\n\nsomething else", prompt)


def test_parse_perf_reads_the_target_section():
    err = """
draft:
llama_perf_context_print: prompt eval time =     100.00 ms /    10 tokens (   10.00 ms per token)
llama_perf_context_print:        eval time =      50.00 ms /     5 runs   (   10.00 ms per token)
target:
common_perf_print:        load time =    8054.62 ms
common_perf_print: prompt eval time =    2003.62 ms /    52 tokens (   38.53 ms per token,    25.95 tokens per second)
common_perf_print:        eval time =    3663.10 ms /    31 runs   (  118.16 ms per token,     8.46 tokens per second)
common_perf_print:       total time =    5677.85 ms /    83 tokens
"""
    perf = b.parse_perf(err, "target:")
    assert perf == {"load_ms": 8054.62, "prompt_eval_ms": 2003.62, "prompt_eval_n": 52, "eval_ms": 3663.1,
                    "eval_n": 31, "total_ms": 5677.85, "total_n": 83}
    assert b.parse_perf(err)["prompt_eval_n"] == 10


def test_counts_from_pipeinfer_json():
    result = {"ranks": [{"rank": 1, "role": "stage", "layers": [17, 28]}, {"rank": 0, "role": "head", "layers": [0, 17]},
                        {"rank": 2, "role": "draft", "layers": [0, 0]}]}
    assert b.counts_from_pipeinfer(result) == [17, 11]
    assert b.counts_from_pipeinfer({"layers_per_host": [14, 14]}) == [14, 14]
    assert b.counts_from_pipeinfer({}) is None


def test_load_compare_reads_every_kind_of_file(tmp_path):
    one = {"prompt_id": "", "text": "a", "mode": "iterative"}
    (tmp_path / "generate.json").write_text(json.dumps(one))
    assert b.load_compare(tmp_path / "generate.json") == [one]
    (tmp_path / "lines.jsonl").write_text(json.dumps(one) + "\n" + json.dumps({**one, "text": "b"}) + "\n")
    assert [r["text"] for r in b.load_compare(tmp_path / "lines.jsonl")] == ["a", "b"]
    bench = {"records": [{**one, "prompt_id": "x", "warmup": True}, {**one, "prompt_id": "x", "text": "c"}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert [r["text"] for r in b.load_compare(tmp_path / "bench.json")] == ["c"]
    ours = {"schema": "pipeinfer-bench-rpc/1", "records": [{"prompt_id": "x", "text": "llama", "pipeinfer": one}]}
    (tmp_path / "rpc.json").write_text(json.dumps(ours))
    got = b.load_compare(tmp_path / "rpc.json")
    assert got == [{**one, "prompt_id": "x"}]
    assert b.compare_for(got, "x", 2)["text"] == "a"
    assert b.compare_for([one], "y", 1) == one  # a lone generate --json names no prompt


def test_first_diff():
    assert b.first_diff("abc", "abc") is None
    assert b.first_diff("abc", "abd") == 2
    assert b.first_diff("ab", "abc") == 2


def test_host_command_enters_the_host_through_the_cluster_launcher():
    """The wrapper Hydra uses for the ranks: it joins the host's cgroups, namespace and hostname."""
    c = b.Cluster("pi-tst", "10.250.3.0/24")
    cmd = b.on_host(c, 1, ["/x/rpc-server", "-H", "10.250.3.3", "-p", "50052"])
    assert cmd == [str(c.wrapper), "pi-tst-h1", "exec /x/rpc-server -H 10.250.3.3 -p 50052"]

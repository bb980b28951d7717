"""`pipeinfer inspect` on tiny written GGUF files and on the real default model."""

import json

import pytest
from typer.testing import CliRunner

from pipeinfer_cli.cli.app import app
from pipeinfer_cli.errors import ModelFileError, UsageError
from pipeinfer_cli.models.gguf_info import read_model_info
from pipeinfer_cli.planner.layer_split import balanced_split

runner = CliRunner()


def inspect_json(path, ranks=2):
    r = runner.invoke(app, ["inspect", str(path), "--json", "--ranks", str(ranks)])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_inspect_tiny_qwen2(tiny_qwen2):
    d = inspect_json(tiny_qwen2, ranks=2)
    assert d["arch"] == "qwen2" and d["n_layer"] == 4 and d["n_embd"] == 64
    assert (d["n_head"], d["n_head_kv"], d["n_ff"], d["n_vocab"]) == (4, 2, 128, 300)
    assert d["tokenizer_model"] == "gpt2"
    # 4 layers x (9 weights + 3 biases) + token_embd + output_norm + output
    assert d["tensor_types"] == {"F32": 4 * 12 + 3}
    per_layer = 4 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64 + 2 * 64 + 64 + 2 * 32)
    assert d["layer_bytes"] == [per_layer] * 4
    # Equal layers, and the last stage also pays the LM head: 2 + 2 beats 3 + 1.
    assert [s["layers"] for s in d["split"]] == [[0, 2], [2, 4]]


def test_inspect_table_output(tiny_llama):
    r = runner.invoke(app, ["inspect", str(tiny_llama), "--ranks", "3"])
    assert r.exit_code == 0
    for text in ("architecture", "llama", "heads / KV heads", "4 / 2", "bytes per layer", "layer split for 3 ranks", "token_embd"):
        assert text in r.stdout


def test_truncated_file_is_reported(tiny_llama, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = tiny_llama.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        read_model_info(cut)
    cut.write_bytes(data[:200])  # inside the header
    with pytest.raises(ModelFileError, match="truncated|not a readable GGUF"):
        read_model_info(cut)


def test_balanced_split():
    assert balanced_split([1] * 8, 2) == [(0, 4), (4, 8)]
    assert balanced_split([1] * 8, 2, last_extra=2) == [(0, 5), (5, 8)]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balanced_split([1, 1, 1, 1, 5, 1], 3) == [(0, 4), (4, 5), (5, 6)]
    # A draft on the head sets the largest cost alone: the other stages are still split evenly,
    # not 1 layer and 9 (both have the same largest cost).
    head, *stages = balanced_split([1] * 10, 3, first_extra=20)
    assert head == (0, 1) and sorted(e - b for b, e in stages) == [4, 5]
    with pytest.raises(UsageError, match="at most 3 ranks"):
        balanced_split([1, 1, 1], 4)


def test_inspect_real_default_model(smollm2_path):
    d = inspect_json(smollm2_path, ranks=2)
    assert d["arch"] == "llama" and d["n_layer"] == 30 and d["n_embd"] == 576
    assert (d["n_head"], d["n_head_kv"], d["n_vocab"]) == (9, 3, 49152)
    assert d["output_tied"] is True
    assert set(d["tensor_types"]) == {"F32", "Q4_1", "Q8_0"}
    r = runner.invoke(app, ["inspect", "smollm2-135m-instruct"])
    assert r.exit_code == 0 and "smollm2-135m-instruct" in r.stdout


# -- the split preview: --draft, --layer-split, token_embd apart ------------------------------------

def test_balanced_split_looks_balanced_token_embd_apart(smollm2_path):
    d = inspect_json(smollm2_path, ranks=2)
    head, last = d["split"]
    # What the split balances: the bytes read per token (layers, plus the LM head on the last stage).
    assert head["per_token_bytes"] == head["layer_bytes"] == sum(d["layer_bytes"][slice(*head["layers"])])
    assert last["per_token_bytes"] == last["layer_bytes"] + d["output_bytes"] and last["lm_head_bytes"] == d["output_bytes"]
    assert max(head["per_token_bytes"], last["per_token_bytes"]) < 1.1 * min(head["per_token_bytes"], last["per_token_bytes"])
    # The head's embedding table is held (memory), not read per token: listed on its own.
    assert head["token_embd_bytes"] == d["token_embd_bytes"] > 0 and last["token_embd_bytes"] == 0
    assert head["weight_bytes"] == head["layer_bytes"] + d["token_embd_bytes"]
    r = runner.invoke(app, ["inspect", str(smollm2_path), "--ranks", "2"], terminal_width=80)
    assert r.exit_code == 0
    header = next(line for line in r.stdout.splitlines() if line.startswith("rank"))
    assert header.split() == ["rank", "role", "layers", "weights", "LM", "head", "draft", "per", "token", "token_embd"]
    assert "…" not in r.stdout.split("layer split for")[1]


def plan_layers(model, world_size, layer_split=None, draft=None):
    from pipeinfer_cli.planner.layout import plan_job

    topo = plan_job(model, str(model), world_size, world_size, layer_split, None, draft, needs_draft=draft is not None)
    return [[p.rank, p.role, list(p.layers)] for p in topo.ranks]


@pytest.mark.parametrize("args, ranks, split, with_draft", [
    (["--ranks", "3"], 3, None, False),
    (["--layer-split", "0.25,0.75"], 2, "0.25,0.75", False),
    (["--layer-split", "0.5,0.5/1", "--draft", "DRAFT"], 3, "0.5,0.5/1", True),
    (["--ranks", "2", "--draft", "DRAFT"], 2, None, True),  # a draft on the head: fewer layers there
    (["--ranks", "2", "--draft", "lookup"], 2, None, False),
])
def test_inspect_previews_the_plan_generate_uses(smollm2_path, args, ranks, split, with_draft):
    args = [str(smollm2_path) if a == "DRAFT" else a for a in args]
    r = runner.invoke(app, ["inspect", str(smollm2_path), "--json", *args])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    got = [[s["rank"], s["role"], s["layers"]] for s in d["split"]]
    assert got == plan_layers(smollm2_path, ranks, split, smollm2_path if with_draft else None)
    size = smollm2_path.stat().st_size
    draft_on = [s["rank"] for s in d["split"] if s["draft_bytes"]]
    if with_draft:
        assert draft_on == [2 if split and "/1" in split else 0]
        assert d["split"][draft_on[0]]["draft_bytes"] == size
    else:
        assert draft_on == []


def test_inspect_draft_moves_layers_off_the_head(smollm2_path):
    plain = inspect_json(smollm2_path, ranks=2)["split"][0]["n_layers"]
    r = runner.invoke(app, ["inspect", str(smollm2_path), "--json", "--ranks", "2", "--draft", "smollm2-135m-instruct"])
    d = json.loads(r.stdout)
    assert d["draft"] == "smollm2-135m-instruct"
    assert d["split"][0]["n_layers"] < plain
    assert d["split"][0]["per_token_bytes"] == d["split"][0]["layer_bytes"] + d["split"][0]["draft_bytes"]


@pytest.mark.parametrize("args, needle", [
    (["--layer-split", "0.5,0.5", "--ranks", "3"], "describes 2 ranks but --ranks is 3"),
    (["--layer-split", "0.5,0.5/1"], "needs a draft model"),
    (["--layer-split", "half,half"], "comma-separated numbers"),
    (["--ranks", "5"], "cannot split 4 layers over 5 ranks"),
    (["--draft", "smolm2"], "did you mean 'smollm2-135m-instruct'?"),
])
def test_inspect_plan_errors_are_one_line(tiny_llama, args, needle):
    r = runner.invoke(app, ["inspect", str(tiny_llama), *args])
    assert r.exit_code != 0
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], r.stderr

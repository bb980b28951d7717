"""`pipeinfer inspect` on tiny written GGUF files and on the real default model."""

import json

import pytest
from typer.testing import CliRunner

from pipeinfer_cli.cli.app import app
from pipeinfer_cli.errors import ModelFileError, UsageError
from pipeinfer_cli.gguf_info import read_model_info
from pipeinfer_cli.layer_split import balanced_split
from tinygguf import write_tiny_model

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
    for text in ("architecture", "llama", "heads / KV heads", "4 / 2", "bytes per layer", "default layer split for 3"):
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

"""Write the fuzzing seeds into tests/fuzz_corpus/seeds/ (run once; the files are committed).

- tiny random models from tests/tinygguf.py, as small as the readers accept (2 layers, n_embd 8,
  264 tokens): llama with a tied LM head, qwen2 with f16 matrices, llama with YaRN RoPE scaling;
- a real model's header: SmolLM2-135M's metadata and full tensor table (272 tensors, real shapes
  and quantization types), with its 49,152-token vocabulary and merges cut to their first entries
  and no tensor data (a reader must call it truncated), and the file's first 16 KiB as they are
  (cut inside the vocabulary).

    .venv/bin/python fuzz/make_seeds.py [--smollm2 PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_struct import T_ARRAY, parse  # noqa: E402
from tinygguf import write_tiny_model  # noqa: E402

SEEDS = ROOT / "tests" / "fuzz_corpus" / "seeds"
TINY = dict(n_layer=2, n_embd=8, n_head=2, n_head_kv=1, n_ff=16, n_vocab=264)


def tiny_seeds() -> None:
    write_tiny_model(SEEDS / "tiny-llama-tied.gguf", arch="llama", tied_output=True, **TINY)
    write_tiny_model(SEEDS / "tiny-qwen2-f16.gguf", arch="qwen2", weight_type="f16", **TINY)
    write_tiny_model(SEEDS / "tiny-llama-yarn.gguf", arch="llama", tied_output=True, rope_scaling=("yarn", 4.0),
                     rope_orig_ctx=128, **TINY)


def real_header_seeds(model: Path, n_tokens: int = 264, n_merges: int = 64) -> None:
    # The metadata ends before the tensor data; SmolLM2's is about 1.8 MB (vocabulary and merges).
    with open(model, "rb") as f:
        head = f.read(4 << 20)
    g = parse(head)
    if g is None:
        raise SystemExit(f"{model}: header does not parse within its first 4 MiB")
    for kv in g.kvs:
        if kv.type == T_ARRAY and kv.key.startswith("tokenizer.ggml."):
            elem, items = kv.value
            kv.value = (elem, items[:n_merges if kv.key.endswith("merges") else n_tokens])
    g.data = b""
    (SEEDS / "smollm2-header-cut-vocab.gguf").write_bytes(g.to_bytes())
    (SEEDS / "smollm2-first-16k.gguf").write_bytes(head[:16 << 10])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, help="SmolLM2-135M GGUF (default: the cached registry model)")
    args = ap.parse_args()
    SEEDS.mkdir(parents=True, exist_ok=True)
    tiny_seeds()
    model = args.smollm2
    if model is None:
        from pipeinfer_cli.models.cache import cached_model_path
        from pipeinfer_cli.models.registry import load_registry

        model = cached_model_path(load_registry().model("smollm2-135m-instruct"))
    real_header_seeds(model)
    for p in sorted(SEEDS.iterdir()):
        print(f"{p.stat().st_size:8d}  {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

"""The three fuzz targets: every reader of a GGUF file pipeinfer has, called as the commands call them.

Each target takes the bytes of one input, writes them to a file (the readers take paths) and runs
the reader. An input must end in success or in a `PipeinferError`, the typed errors the CLI turns
into one `Error:` line. Any other exception propagates (the fuzzer records the input as a crash);
so does a native crash, a hang (the driver's -timeout) and a memory blow-up (-rss_limit_mb, and the
address-space limit the driver sets).

- metadata: `read_model_info` (what `inspect` and job planning read) + the split for 2 ranks and
  for 2 stages with a draft rank + the JSON and the tables `inspect` prints;
- native: the layer engine opening a layer range (chosen from the input) through the Python
  binding, then one token (or one hidden-state row) through it;
- tokenizer: the head's tokenizer (llama.cpp's vocabulary load, through llama-cpp-python), a
  prompt, a chat through the model's template, detokenizing, the draft vocabulary check.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zlib
from pathlib import Path

TARGETS = ("metadata", "native", "tokenizer")

_DIR = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
_PATH = _DIR / f"pipeinfer-fuzz-{os.getpid()}.gguf"


def input_file(data: bytes) -> Path:
    """The input as a file, rewritten in place for every input (one per fuzzing process)."""
    with open(_PATH, "wb") as f:
        f.write(data)
    return _PATH


def cleanup() -> None:
    _PATH.unlink(missing_ok=True)


def run_metadata(path: Path) -> None:
    from rich.console import Console

    from pipeinfer_cli.cli.inspect_cmd import _layer_bytes_table, _summary_table
    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.planner.layout import plan_split

    info = read_model_info(path)
    json.dumps({**info.to_dict(), "split": plan_split(info, 2).ranks})
    console = Console(file=io.StringIO(), width=120)
    console.print(_summary_table("fuzz", info))
    console.print(_layer_bytes_table(info))
    plan_split(info, 3, "1,1/1", draft_bytes=1000)


def _layer_range(n_layer: int, data: bytes) -> tuple[int, int]:
    """A range within the planned layers, picked from the input so each input opens the same one."""
    if n_layer < 1:
        return 0, 1
    choices = [(0, n_layer), (0, 1), (n_layer - 1, n_layer), (n_layer // 2, n_layer)]
    return choices[zlib.crc32(data[:4096]) % len(choices)]


def run_native(path: Path, data: bytes) -> None:
    import numpy as np

    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.native import LayerEngine

    info = read_model_info(path)  # the job plans its ranks from this before any rank loads
    begin, end = _layer_range(info.n_layer, data)
    eng = LayerEngine(path, begin, end, n_ctx=8, n_threads=1, n_seq_max=1)
    if eng.is_first:
        eng.eval(tokens=[0], pos=[0], seq_ids=[[0]])
    else:
        eng.eval(embd=np.zeros((1, eng.n_embd), np.float32), pos=[0], seq_ids=[[0]])


def run_tokenizer(path: Path) -> None:
    from pipeinfer_cli.runtime.tokenizer import Tokenizer
    from pipeinfer_cli.runtime.vocab import draft_vocab

    tok = Tokenizer(path)
    ids = tok.encode("Hello, world! <|im_end|> é 日本 \n\t x")
    dec = tok.decoder()
    for t in [*ids, 0, tok.n_vocab - 1]:
        dec.push(t)
        tok.is_eog(t)
    dec.flush()
    draft_vocab(tok, tok)
    tok.chat_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def run_checked(target: str, data: bytes) -> None:
    """One input through one target; returns on success, raises the typed error or anything else."""
    path = input_file(data)
    if target == "metadata":
        run_metadata(path)
    elif target == "native":
        run_native(path, data)
    elif target == "tokenizer":
        run_tokenizer(path)
    else:
        raise ValueError(f"unknown fuzz target {target!r}; one of {', '.join(TARGETS)}")


def run(target: str, data: bytes) -> None:
    """As run_checked, with a typed error (the CLI's one `Error:` line) counted as a clean end."""
    from pipeinfer_cli.errors import PipeinferError

    try:
        run_checked(target, data)
    except PipeinferError:
        pass

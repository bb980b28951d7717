#!/usr/bin/env python3
"""CPU milliseconds per drafted token of each draft model, through the drafter the jobs use
(`decode.drafters.LlamaDrafter`, 1 thread): a 60-token prompt, then 8 proposals of 4 tokens, each
continuing 2 accepted tokens and a corrected one (so the draft's resync is counted too).

    .venv/bin/python scripts/draft_cost.py [MODEL ...]        # registry names or .gguf paths
    scripts/emulate-cluster.sh on 0 -- .venv/bin/python scripts/draft_cost.py   # on a capped host
"""

from __future__ import annotations

import sys
import time

from pipeinfer_cli.decode.drafters import LlamaDrafter
from pipeinfer_cli.models.model_files import resolve_model
from pipeinfer_cli.models.registry import load_registry

DEFAULT = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


def main(names: list[str]) -> None:
    registry = load_registry()
    for name in names or DEFAULT:
        d = LlamaDrafter(resolve_model(name, registry).path, n_ctx=512, n_threads=1)
        prompt = list(range(100, 160))
        d.start(prompt)
        path, n = list(prompt), 0
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(8):
            p = d.propose(path, 4, 0.0)
            n += len(p.tokens)
            path = path + list(p.tokens)[:2] + [5]
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(f"{name}: {1000 * cpu / n:.1f} CPU ms and {1000 * wall / n:.1f} ms per drafted token ({n} tokens)")
        d.close()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Hand-made profiles and traces for the planner's tests: costs chosen so the arithmetic is known."""

from __future__ import annotations

from pipeinfer_cli.planner.profile import CostGrid, DraftCosts, LinkCosts, ModelFacts, Profile, RankCosts
from pipeinfer_cli.planner.replay import PromptTrace


def rank_costs(rank: int, per_layer: float = 1e-3, per_row: float | None = None, output_row_s: float = 0.0,
               overhead_s: float = 0.0, speed: float = 1.0) -> RankCosts:
    """A rank whose layer costs per_layer for one row and per_row more for each further row
    (per_row=0: verification is free; None: each row costs a whole one-row run)."""
    step = per_layer if per_row is None else per_row
    rows = [1, 2, 4, 8]
    decode = CostGrid(rows, [0], [[(per_layer + step * (r - 1)) / speed for r in rows]])
    prefill = CostGrid([1, 256], [0], [[per_layer / speed, 256 * per_layer / speed]])
    # node<rank>: a host of its own with 2 CPUs, computing with the 2 threads a job there defaults to
    return RankCosts(rank, f"node{rank}", "test cpu", 2, 2, 8 << 30, 8 << 30, decode, prefill, output_row_s / speed,
                     overhead_s, [0, 1], usable_cpus=2.0, ranks_per_host=1)


def make_profile(n_ranks: int = 1, n_layer: int = 20, latency_s: float = 0.0, bytes_per_s: float = 1e12,
                 draft_token_s: float = 0.0, ranks: list[RankCosts] | None = None, file_bytes: int = 1000,
                 sha256: str = "0" * 64) -> Profile:
    model = ModelFacts("test-model", file_bytes, "llama", n_layer, 64, 1000, [100] * n_layer, 100, sha256)
    links = [LinkCosts(a, b, latency_s, bytes_per_s) for a in range(n_ranks) for b in range(n_ranks) if a != b]
    return Profile(model, ranks or [rank_costs(i) for i in range(n_ranks)], links,
                   DraftCosts("model", "test-draft", 0, 1, draft_token_s, 0.0), created="test")


def prompt_trace(n_gen: int = 41, n_prompt: int = 20) -> PromptTrace:
    prompt = list(range(100, 100 + n_prompt))
    tokens = [200 + (i * 7) % 50 for i in range(n_gen)]
    return PromptTrace("t", prompt, tokens, "length")


def smollm2_profile(model_path, directory):
    """A profile for SmolLM2's header: two ranks on hosts of their own, the second twice as slow,
    with a draft model's costs; saved as directory/profile.json."""
    from pathlib import Path

    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.planner.identity import model_sha256

    info = read_model_info(model_path)
    prof = make_profile(2, n_layer=info.n_layer, ranks=[rank_costs(0), rank_costs(1, speed=0.5)],
                        file_bytes=info.file_size, latency_s=2e-4, draft_token_s=1e-3, sha256=model_sha256(model_path))
    prof.model.layer_bytes, prof.model.n_embd = info.layer_bytes, info.n_embd
    path = Path(directory) / "profile.json"
    prof.save(path)
    return path

#!/usr/bin/env python3
"""Time to first token of a second chat turn, with and without prefix reuse, in one MPI job.

The first turn is a long user message (a list of notes, about 900 tokens with SmolLM2's or Qwen's
tokenizer); the second asks a short question about it. Per repeat, on models loaded once:

- reuse: clear the caches, answer turn 1, answer turn 2 (it keeps the reusable prefix of turn 1);
- fresh: clear the caches, answer turn 1, clear the caches, answer turn 2 (the whole prompt again).

The two arms alternate (reuse first on even repeats, fresh first on odd ones), and the script checks
that both printed the same tokens. TTFT is the engine's `ttft_s` (start of prompt processing →
first token at the head). Prints a table and writes JSON (--json). Starts itself under the bundled
mpiexec with --ranks R (default 2), through pipeinfer's launcher; under an external launcher the
world size decides.

    .venv/bin/python -m benchmarks.prefix_reuse smollm2-135m-instruct --ranks 2 --repeat 5 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

NOTES = "Here are my notes from this week:\n" + "\n".join(
    f"{i + 1}. The {colour} {animal} {verb} near the {place} on {day}."
    for i, (colour, animal, verb, place, day) in enumerate(
        (c, a, v, p, d)
        for c in ("red", "blue", "green", "grey", "white")
        for a, v in (("fox", "ran"), ("owl", "slept"), ("deer", "ate"), ("hare", "hid"), ("crow", "sang"),
                     ("boar", "dug"), ("lynx", "waited"), ("stag", "called"))
        for p, d in ((("river", "Monday"),) if c in ("red", "green", "white") else (("old mill", "Friday"),))
    )) + "\nPlease keep them in mind."
QUESTION = "Which animals were seen near the old mill?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="registry name, pair name (its target is used) or .gguf path")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("-n", "--n-predict", type=int, default=16, help="tokens per answer")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--json", dest="json_path", help="write the records and the summary here")
    args = ap.parse_args()
    from pipeinfer_cli.transport.launch import under_mpi_launcher

    if not under_mpi_launcher() and args.ranks > 1:
        from benchmarks.runner import relaunch_self

        return relaunch_self(args.ranks, sys.argv[1:], "benchmarks.prefix_reuse")
    from pipeinfer_cli.cli.app import omp_wait_policy

    if (policy := omp_wait_policy()) is not None:  # as `pipeinfer` sets it, before libgomp loads
        os.environ["OMP_WAIT_POLICY"] = policy
    return run(args)


def run(args) -> int:
    from pipeinfer_cli.runtime.job import JobConfig, Request, run_head_loop
    from pipeinfer_cli.decode.session import DecodeOptions
    from benchmarks.runner import target_model

    label, path = target_model(args.model)
    cfg = JobConfig(model_path=path, model_label=label, draft_path=None,
                    decode=DecodeOptions(n_predict=args.n_predict), n_ctx=args.ctx, reuse_prefix=True)
    records: list[dict] = []

    def answer(head, messages: list[dict]):
        req = Request(mode="iterative", chat=messages)
        return head.run(req, head.tokenize(req))

    def one(head, arm: str, rep: int) -> None:
        head.reset()
        turn1 = [{"role": "user", "content": NOTES}]
        first = answer(head, turn1)
        if arm == "fresh":
            head.reset()
        second = answer(head, turn1 + [{"role": "assistant", "content": first.text},
                                       {"role": "user", "content": QUESTION}])
        records.append({"arm": arm, "repeat": rep, "ttft_s": second.ttft_s, "n_prompt": second.n_prompt,
                        "reused_tokens": second.reused_tokens, "first_n_prompt": first.n_prompt,
                        "tokens": second.tokens})
        print(f"repeat {rep} {arm}: TTFT {second.ttft_s * 1e3:.0f} ms, reused {second.reused_tokens}"
              f"/{second.n_prompt}", file=sys.stderr, flush=True)

    def head_main(head) -> None:
        for rep in range(args.repeat):
            for arm in (("reuse", "fresh") if rep % 2 == 0 else ("fresh", "reuse")):
                one(head, arm, rep)

    if not run_head_loop(cfg, head_main, needs_draft=False):
        return 0
    return report(args, label, records)


def report(args, label: str, records: list[dict]) -> int:
    from benchmarks.figures import spread
    from benchmarks.report import fmt_spread, markdown_table, publish

    by = {arm: [r for r in records if r["arm"] == arm] for arm in ("fresh", "reuse")}
    same = len({tuple(r["tokens"]) for r in records}) == 1
    ttft = {arm: spread((r["ttft_s"] * 1e3 for r in rs), 1) for arm, rs in by.items()}
    summary = {"model": label, "ranks": args.ranks, "repeat": args.repeat,
               "first_turn_prompt_tokens": records[0]["first_n_prompt"], "second_turn_prompt_tokens": records[0]["n_prompt"],
               "reused_tokens": by["reuse"][0]["reused_tokens"], "ttft_fresh_ms": ttft["fresh"],
               "ttft_reuse_ms": ttft["reuse"], "speedup": ttft["fresh"]["median"] / ttft["reuse"]["median"],
               "tokens_identical": same}
    publish(markdown_table(["model", "ranks", "turn-2 prompt", "reused", "TTFT fresh (ms)", "TTFT reuse (ms)", "speedup",
                            "same tokens"],
                           [[label, str(args.ranks), str(summary["second_turn_prompt_tokens"]), str(summary["reused_tokens"]),
                             fmt_spread(ttft["fresh"], ".0f"), fmt_spread(ttft["reuse"], ".0f"),
                             f"{summary['speedup']:.2f}×", "yes" if same else "NO"]], "l" * 8),
            {"summary": summary, "records": records}, args.json_path)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

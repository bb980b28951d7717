#!/usr/bin/env python3
"""llama.cpp's own greedy decoding (llama-cpp-python, one process) on a `pipeinfer bench` prompt set.

The reference that `make bench` compares every pipeinfer mode against, at the same total threads.
With --lookup, llama.cpp's prompt-lookup decoding instead (llama-cpp-python's
`LlamaPromptLookupDecoding` draft model in `Llama.generate`: draft up to --lookup-tokens tokens
by matching the last 1..--lookup-ngram tokens earlier in the text, verify them in one batch).
`--prompts` takes a shipped set's name (`default`, `grounded`) or a JSONL file, as `pipeinfer bench`.
Prompts are tokenized exactly as `pipeinfer bench` does (the model's chat template for `messages`),
generation stops at end-of-generation or -n like a bench request, and the metrics follow
design.md: tok_per_s = n_gen / (t_last_token - t_start), decode_tok_per_s = (n_gen - 1) /
(t_last_token - t_first_token). Writes JSON (--json) and prints one line per prompt on stderr.

    python -m benchmarks.llamacpp qwen-coder -n 128 --threads 2 --json build/bench_llamacpp.json
    python -m benchmarks.llamacpp qwen-coder --prompts grounded -n 96 --threads 2 --lookup --ctx 1024 --json build/lookup.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def generate(llm, lib, prompt: list[int], n_predict: int, is_eog) -> dict:
    import numpy as np

    llm.reset()
    lib.llama_memory_clear(lib.llama_get_memory(llm.ctx), True)
    t_start = time.perf_counter()
    llm.eval(prompt)
    times, tokens = [], []
    n_vocab = llm.n_vocab()
    while True:
        # The last evaluated row's logits, straight from the context (no copy into llm.scores).
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        tokens.append(tok)
        times.append(time.perf_counter())
        if is_eog(tok) or len(tokens) >= n_predict:
            break
        llm.eval([tok])
    return _record(prompt, tokens, times, t_start)


def generate_lookup(llm, lib, prompt: list[int], n_predict: int, is_eog) -> dict:
    """Greedy decoding through `Llama.generate` with the prompt-lookup draft model the Llama was built with."""
    llm.reset()
    lib.llama_memory_clear(lib.llama_get_memory(llm.ctx), True)
    t_start = time.perf_counter()
    times, tokens = [], []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        times.append(time.perf_counter())
        if is_eog(tok) or len(tokens) >= n_predict:
            break
    return _record(prompt, tokens, times, t_start)


def _record(prompt: list[int], tokens: list[int], times: list[float], t_start: float) -> dict:
    n = len(tokens)
    return {"n_prompt": len(prompt), "n_gen": n, "tokens": tokens, "ttft_s": times[0] - t_start,
            "tok_per_s": n / (times[-1] - t_start),
            "decode_tok_per_s": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="pair name (its target is used), registry name or .gguf path")
    ap.add_argument("--prompts", default=None, help="shipped prompt set (default, grounded) or a JSONL file (default: default)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--lookup", action="store_true", help="llama.cpp's prompt-lookup decoding instead of plain decoding")
    ap.add_argument("--lookup-ngram", type=int, default=2, help="longest n-gram matched (LlamaPromptLookupDecoding's max_ngram_size; its default)")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="tokens drafted per match (its num_pred_tokens; its default)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()

    import llama_cpp

    from benchmarks.figures import median
    from benchmarks.report import write_json
    from benchmarks.runner import target_model
    from pipeinfer_cli.bench.environment import host_facts, versions
    from pipeinfer_cli.bench.prompts import load_prompts
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    label, path = target_model(args.model)
    prompts = load_prompts(args.prompts, args.limit)
    tok = Tokenizer(path)
    ids = {p.id: tok.chat_messages(list(p.messages)) if p.messages else tok.encode(p.prompt) for p in prompts}
    draft = None
    if args.lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=args.lookup_ngram, num_pred_tokens=args.lookup_tokens)
    # With a draft model, Llama keeps every row's logits (ctx × vocab floats, 2.5 GB at --ctx 4096
    # for Qwen: pass --ctx 1024) but sizes that array only if logits_all is passed too.
    llm = llama_cpp.Llama(str(path), n_ctx=args.ctx, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, draft_model=draft, logits_all=args.lookup, verbose=False)
    run = generate_lookup if args.lookup else generate
    name = "llama.cpp lookup" if args.lookup else "llama.cpp"
    for w in range(args.warmup):
        run(llm, llama_cpp, ids[prompts[w % len(prompts)].id], args.n_predict, tok.is_eog)
    records = []
    for rep in range(args.repeat):
        for p in prompts:
            r = run(llm, llama_cpp, ids[p.id], args.n_predict, tok.is_eog)
            records.append({"prompt_id": p.id, "repeat": rep, **r})
            print(f"{name} {p.id}: {r['n_prompt']} prompt tokens, {r['n_gen']} tokens, {r['tok_per_s']:.2f} tok/s, "
                  f"decode {r['decode_tok_per_s'] or 0:.2f} tok/s", file=sys.stderr)
    med = {k: median(r[k] for r in records) for k in ("tok_per_s", "decode_tok_per_s")}
    engine = ("llama.cpp prompt-lookup decoding (llama-cpp-python LlamaPromptLookupDecoding, "
              f"max_ngram_size={args.lookup_ngram}, num_pred_tokens={args.lookup_tokens}, greedy, one process)"
              if args.lookup else "llama.cpp (llama-cpp-python, greedy, one process)")
    doc = {"engine": engine, "model": label, "path": str(path),
           "threads": args.threads, "n_predict": args.n_predict, "repeat": args.repeat, "warmup": args.warmup,
           "command": " ".join(["python", *sys.argv]), "versions": versions(), "host": host_facts(),
           "prompts": args.prompts or "default", "median": med, "records": records}
    write_json(args.json, doc)
    print(f"{name} median: {med['tok_per_s']:.2f} tok/s, decode {med['decode_tok_per_s']:.2f} tok/s "
          f"({args.threads} threads) -> {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A job of several requests on models loaded once, with prefix reuse, for tests/test_prefix_reuse.py.

Run under mpiexec: `mpiexec -n R python tests/reuse_job.py SPEC_JSON`. SPEC: model, draft (path,
"lookup" or null), mode, n, ctx, layer_split, reuse (bool), and steps: {"prompt": raw text},
{"user": chat message} (the conversation so far, answers included, through the chat template),
or "reset". After the steps, the last request is run once more from an empty cache ("fresh").
Rank 0 prints one JSON line per request: tokens, text, n_prompt, n_gen, reused_tokens,
common_prefix_tokens, acceptance, and the KV cells in use on every rank afterwards.
"""

import json
import sys
from pathlib import Path

from pipeinfer_cli.runtime.job import JobConfig, Request, run_head_loop
from pipeinfer_cli.decode.draft_spec import DraftSpec
from pipeinfer_cli.decode.session import DecodeOptions


def main() -> None:
    spec = json.loads(sys.argv[1])
    draft = DraftSpec.parse(spec.get("draft"))
    cfg = JobConfig(model_path=Path(spec["model"]), model_label="model",
                    draft_path=Path(draft.model) if draft.uses_model else None, draft=draft,
                    decode=DecodeOptions(n_predict=spec["n"], p_accept=spec.get("p_accept", 0.5)),
                    n_ctx=spec.get("ctx", 2048), layer_split=spec.get("layer_split"), reuse_prefix=spec["reuse"])
    mode = spec["mode"]

    def emit(kind: str, head, result=None) -> None:
        line = {"kind": kind, "kv": {str(k): v for k, v in head.kv_used_cells().items()}}
        if result is not None:
            r = result.to_json()
            line.update({k: r[k] for k in ("tokens", "text", "n_prompt", "n_gen", "reused_tokens",
                                           "common_prefix_tokens", "acceptance")})
        print(json.dumps(line), flush=True)

    def head_main(head) -> None:
        history: list[dict] = []
        last = None
        for step in spec["steps"]:
            if step == "reset":
                head.reset()
                history = []
                emit("reset", head)
                continue
            if "user" in step:
                history = history + [{"role": "user", "content": step["user"]}]
                last = Request(mode=mode, chat=history)
            else:
                last = Request(mode=mode, prompt=step["prompt"])
            r = head.run(last, head.tokenize(last))
            if "user" in step:
                history = history + [{"role": "assistant", "content": r.text}]
            emit("request", head, r)
        head.reset()
        emit("fresh", head, head.run(last, head.tokenize(last)))

    run_head_loop(cfg, head_main, needs_draft=mode != "iterative")


if __name__ == "__main__":
    main()

"""Requests resumed from their committed tokens, for tests/test_resume.py.

Run under mpiexec: `mpiexec -n R python tests/resume_job.py SPEC_JSON`. SPEC: model, draft (path,
"lookup" or null), mode, n, prompt, temp, seed, stop (list), cuts (how many committed tokens each
resumed run starts from). Rank 0 runs the request once from the start, recording the text shown
after every token, then once per cut with `resume` = the first `cut` tokens, and prints one JSON
line per run: the tokens, the whole text, and the text shown by the run itself.
"""

import json
import sys
from pathlib import Path

from pipeinfer_cli.decode.draft_spec import DraftSpec
from pipeinfer_cli.decode.sampling import SamplingParams
from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.runtime.head import Callbacks
from pipeinfer_cli.runtime.job import JobConfig, Request, run_head_loop


def main() -> None:
    spec = json.loads(sys.argv[1])
    draft = DraftSpec.parse(spec.get("draft"))
    cfg = JobConfig(model_path=Path(spec["model"]), model_label="model",
                    draft_path=Path(draft.model) if draft.uses_model else None, draft=draft,
                    decode=DecodeOptions(n_predict=spec["n"]), n_ctx=2048, reuse_prefix=False)
    sampling = SamplingParams(temperature=spec.get("temp", 0.0), seed=spec.get("seed", 0))

    def run(head, resume: list[int]) -> dict:
        shown: list[str] = []
        after_token: list[int] = []  # how much text was shown once each token was committed
        cb = Callbacks(on_token=lambda t: after_token.append(len("".join(shown))), on_text=shown.append)
        req = Request(mode=spec["mode"], prompt=spec["prompt"], sampling=sampling, stop=spec.get("stop", []),
                      resume=resume)
        r = head.run(req, head.tokenize(req), cb)
        return {"tokens": r.tokens, "text": r.text, "shown": "".join(shown), "finish": r.finish_reason,
                "shown_before": after_token}

    def head_main(head) -> None:
        first = run(head, [])
        print(json.dumps({"cut": 0, **first}), flush=True)
        for cut in spec["cuts"]:
            if cut < len(first["tokens"]):
                print(json.dumps({"cut": cut, **run(head, first["tokens"][:cut])}), flush=True)

    run_head_loop(cfg, head_main, needs_draft=spec["mode"] != "iterative")


if __name__ == "__main__":
    main()

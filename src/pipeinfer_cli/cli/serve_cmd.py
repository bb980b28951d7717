"""`pipeinfer serve`: load the models once and answer OpenAI-compatible HTTP requests."""

from __future__ import annotations

from typing import Annotated

import typer

from ..decode.parallel_policy import LOAD_POLICIES
from ..errors import OptionValueError
from .job_options import JobOptions, job_options
from .job_setup import begin_job
from .options import ModelOption, ModeOption, OptionalModelArg
from .serve_in_job import serve_on_this_rank
from .serve_options import announce_split, check_parallel, default_split
from .wording import epilog

API_KEY_ENV = "PIPEINFER_API_KEY"

EPILOG = epilog("""Examples:

  pipeinfer serve smollm2-135m-instruct --ranks 2 --draft lookup

  pipeinfer serve qwen-coder --ranks 2 --port 8081 --queue 4 \\
      --api-key "$(cat key.txt)"

  pipeinfer serve qwen2.5-coder-1.5b-instruct --ranks 2 \\
      --parallel 2 --ctx 8192

  curl -N http://127.0.0.1:8080/v1/chat/completions \\
      -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

The API: POST /v1/chat/completions, POST /v1/completions (OpenAI format, streaming with "stream":
true), GET /v1/models, GET /health ({"status": "loading"} with 503 until ready, then {"status":
"ok"}), GET /metrics (Prometheus). A request's "mode" field chooses its mode; the server's --mode
applies otherwise, and "speculative" or "pipeinfer" need a server started with a draft (--draft or
a pair name). -n, --temp, --top-k, --top-p, --min-p and --seed are the defaults of requests that do
not set them. Responses name the loaded model, whatever the request's "model" says.

One request is generated at a time, or up to --parallel N at once: each then has its own KV slot
(--ctx / N cells, in whole 256-cell blocks, and its own prefix reuse), and their runs follow each
other through the stages, so while one request's run is on stage 2 another's is on stage 1. Every
request gets exactly the tokens it would get alone. --load-policy says when a request may
speculate beside others; GET /slots shows what each slot does. On several ranks without
--layer-split, --parallel N balances the layers by measured time for N requests at once
(--layer-split auto on --profile, else on a quick calibration cached per machine, model and job
shape, made at the first start); `pipeinfer plan MODEL --parallel N` predicts it. Up to --queue more requests wait in
order, and beyond that the server answers 503 with Retry-After.

This command is the server's front: it answers HTTP (where --host is bound) and starts the job
(HYDRA_HOST_FILE for other hosts). When a rank, a host or a link is lost, it starts the job again
on the hosts that still answer and every request in flight resumes from its committed tokens,
with exactly the text it would have had (/health says "degraded"; /metrics counts restarts); at
most --max-restarts times in 10 minutes. Ctrl-C or SIGTERM stops the server: requests in progress
end with an error, it prints `pipeinfer serve: stopped by SIGTERM` (or SIGINT) and exits with status
0. SIGHUP plans the job again over every host of the hostfile.
""")


@job_options
def serve(
    model: OptionalModelArg = None,
    model_opt: ModelOption = None,
    mode: ModeOption = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface; "
                                      "then set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port to listen on.")] = 8080,
    queue: Annotated[int, typer.Option("--queue", min=0, max=10000, help="Requests that may wait behind the ones "
                                       "being generated; more get 503 with Retry-After.")] = 8,
    parallel: Annotated[int, typer.Option("--parallel", "-np", min=1, max=32,
                                          help="Requests generated at once (llama-server's -np), each in its own "
                                               "KV slot of --ctx / N cells; their runs share the stages.")] = 1,
    load_policy: Annotated[str, typer.Option("--load-policy", metavar="yield|round-robin|no-spec",
                                             help="With --parallel: when a request may speculate beside others. "
                                                  "yield: only on stages no other request's next token needs; "
                                                  "round-robin: as if alone; no-spec: never while two or more "
                                                  "run.")] = "yield",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar=API_KEY_ENV, show_default=False,
                                                help=f"Require `Authorization: Bearer KEY` on /v1/*, /metrics and /slots "
                                                     f"(or set {API_KEY_ENV}).")] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, max=1000,
                                              help="Times the job may be started again in 10 minutes after a rank, "
                                                   "host or link was lost (requests in flight resume with the same "
                                                   "text); past that the server exits 1.")] = 3,
    prefix_reuse: Annotated[bool, typer.Option("--prefix-reuse/--no-prefix-reuse",
                                               help="Keep the KV cells a request shares with the previous one "
                                                    "(whole 256-token prompt chunks, so answers are unchanged); "
                                                    "timings.cache_n says how many were reused.")] = True,
    job: JobOptions = None,
) -> None:
    """Serve the OpenAI HTTP API from the models loaded once, with the layers split across MPI ranks.

    This command answers HTTP and starts the job (rank 0 takes the requests); a lost rank, host or
    link is survived: the job is started again and the requests in flight resume with the same text.
    Every answer is generated in the request's mode (lossless speculation), and the response's
    `timings` say how the speculation went.
    """
    from ..transport.launch import under_mpi_launcher
    from .job_setup import check_world

    _check_options(api_key, load_policy, parallel)
    if not under_mpi_launcher():
        from .serve_front import serve_from_front

        raise typer.Exit(serve_from_front(model, model_opt, mode, job, host, port, queue, parallel, load_policy,
                                           api_key, prefix_reuse, max_restarts))
    # A rank of a job: started by the front, or under a launcher of the user's own.
    split_rule = default_split(job, parallel)
    prep = begin_job(model, model_opt, mode, job, parallel=parallel, drafts=True,
                     settings={"reuse_prefix": prefix_reuse, "parallel": parallel, "load_policy": load_policy}).prep
    check_parallel(prep.cfg)
    announce_split(split_rule, prep.plan)
    check_world(prep.ranks, explicit=prep.explicit_ranks)
    serve_on_this_rank(prep.plan, host, port, queue, api_key)


def _check_options(api_key: str | None, load_policy: str, parallel: int) -> None:
    if api_key is not None and not api_key.strip():
        raise OptionValueError(f"--api-key (or {API_KEY_ENV}) is empty; give a key or leave it unset")
    if load_policy not in LOAD_POLICIES:
        raise OptionValueError(f"--load-policy {load_policy!r} is not one of {', '.join(LOAD_POLICIES)}")
    if load_policy != "yield" and parallel == 1:
        raise OptionValueError(f"--load-policy {load_policy} applies to parallel requests; give --parallel N "
                               "(N > 1) too")

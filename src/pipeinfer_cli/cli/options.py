"""Shared option aliases, so every command spells the same option the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

SaveTraceOption = Annotated[Path | None, typer.Option("--save-trace", metavar="FILE", show_default=False, help="Save the run as a trace that `pipeinfer plan --trace FILE` replays: the prompt and committed tokens and, with a draft model, its greedy chains from every committed prefix (asked of the job's draft after the run, outside its timings). Written whole or not at all; greedy decoding only.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout.")]
RanksOption = Annotated[int, typer.Option("--ranks", "-r", min=1, help="Number of pipeline stages (MPI ranks) to plan for.")]

# -- options shared by the commands that run a job (generate, bench) --------------------------------
ModelArg = Annotated[str, typer.Argument(help="Target model: registry name, pair name (target + draft), or .gguf path.")]
OptionalModelArg = Annotated[str | None, typer.Argument(show_default=False, help="Target model: registry name, pair name (target + draft), or .gguf path (or use -m).")]
ModelOption = Annotated[str | None, typer.Option("--model", "-m", show_default=False, help="The target model, as with llama.cpp's -m (same as the MODEL argument).")]
ModeOption = Annotated[str | None, typer.Option("--mode", "-M", show_default=False, help="iterative: one token per pass through the pipeline. speculative: draft --n-draft tokens, verify them in one batch (standard synchronous speculation). pipeinfer: asynchronous pipelined speculation with early cancellation. auto: the mode and settings (n_draft, p_accept, max_inflight) that `pipeinfer plan --search` predicts fastest on these ranks, from --profile (without one: a quick calibration, cached per machine, model and job shape, reused next time). The draft's acceptance is measured where it can be (prompt lookup: on the prompt of `generate`; a draft model: if `calibrate --draft` measured it) and otherwise assumed to be 60%; the choice and its acceptance are stated on stderr. In `chat`, the settings (not the mode) are planned again between turns when the acceptance measured so far leaves the planned one by more than 0.15 (over 16 drafted tokens or more), and a line says so. Default: pipeinfer when there is a draft (--draft or a pair name), else iterative.")]
DraftOption = Annotated[str | None, typer.Option("--draft", "-md", help="Draft model (name or .gguf path; any vocabulary: one that is not the target's is translated through text, if both tokenizers spell text back byte for byte), 'lookup' for prompt-lookup drafting, 'suffix' for suffix drafting (the prompt, the answer so far and, in one job, earlier requests' prompts and answers: chat turns, serve requests, bench prompts; no model), or 'lookup+MODEL' / 'suffix+MODEL': lookup or suffix where it has a confident match, the model elsewhere.")]
NPredictOption = Annotated[int, typer.Option("--n-predict", "-n", help="Tokens to generate (stops earlier at end of generation); -1 = until end of generation or a full context.")]
TempOption = Annotated[float, typer.Option("--temp", min=0.0, help="Temperature; 0 = greedy.")]
TopKOption = Annotated[int, typer.Option("--top-k", min=0, help="Sample among the k most likely tokens (0 = all).")]
TopPOption = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling threshold (1 = off).")]
MinPOption = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens whose probability is below min-p times the most likely one's (0 = off).")]
StopOption = Annotated[list[str] | None, typer.Option("--stop", metavar="TEXT", show_default=False, help="Stop when this text appears (not printed); repeat for several.")]
SeedOption = Annotated[int, typer.Option("--seed", "-s", help="Sampling seed; each token depends only on (logits, seed, position).")]
NDraftOption = Annotated[int, typer.Option("--n-draft", min=1, max=64, help="Max draft tokens per speculative run.")]
DraftMinOption = Annotated[int, typer.Option("--draft-min", min=0, max=64, help="speculative and pipeinfer: a draft shorter than this many tokens is not verified (llama.cpp's --draft-min); 0: any draft.")]
PMinOption = Annotated[float, typer.Option("--p-min", min=0.0, max=1.0, help="speculative: stop drafting when the draft's top probability is below this.")]
PAcceptOption = Annotated[float, typer.Option("--p-accept", "-pa", min=0.0, max=1.0, help="pipeinfer: keep speculating while draft confidence >= p_accept + p_adjust.")]
PSplitOption = Annotated[float, typer.Option("--p-split", "-ps", min=0.0, max=1.0, help="pipeinfer: open a tree branch when a runner-up draft token has p > p_split.")]
PRecoveryOption = Annotated[float, typer.Option("--p-recovery", "-pr", min=0.0, help="pipeinfer: p_adjust grows by this per run launched this round.")]
PDecayOption = Annotated[float, typer.Option("--p-decay", "-pd", min=0.0, help="pipeinfer: p_adjust shrinks by this per rejected run.")]
MaxBranchesOption = Annotated[int, typer.Option("--max-branches", min=1, max=8, help="pipeinfer: sequences a token tree may use (1 = no trees).")]
SpecPolicyOption = Annotated[str, typer.Option(
    "--spec-policy", metavar="auto|always",
    help="pipeinfer on one stage with the drafter on the head (nothing idle to fill): auto drafts only while "
         "drafting pays, measured run by run (the time accepted tokens saved against the drafting and "
         "verification time), else decodes one token at a time with a probe now and then; a draft model "
         "reads the prompt only after a first probe from the last 32 tokens says it may pay, and a draft "
         "that cannot pay is not tried again in the same job. always drafts whenever the draft is "
         "confident. Several stages, or a draft rank: always.")]
MaxInflightOption = Annotated[int, typer.Option("--max-inflight", min=1, max=32, help="pipeinfer: runs in flight at once.")]
PReachOption = Annotated[float, typer.Option("--p-reach", min=0.0, max=1.0, help="pipeinfer: draft a token only while the chance that it is reached (the acceptance measured so far, to the power of the drafted tokens ahead of it) is at least this, or at least what drafting and verifying it costs against what it saves when the measured timings say that is less (cheap batch rows); 0: as far as --n-draft and --max-inflight allow.")]
JobRanksOption = Annotated[int | None, typer.Option("--ranks", "-r", min=1, help="Ranks to start with mpiexec: on this machine, or on the hosts of the hostfile HYDRA_HOST_FILE names, one per slot in order (a line on stderr names a host that gets more ranks than its slots) (default: the MPI world size, or 1).")]
LayerSplitOption = Annotated[str | None, typer.Option("--layer-split", help="Fractions of the layers per target stage, '/1' for a draft rank: 0.5,0.5 or 0.5,0.5/1; or auto (auto/1): balanced by the time each rank measured (its --profile; generate, bench, chat and serve calibrate one quickly when none is given). Default: balanced by bytes (serve --parallel N on several ranks: auto, for N requests at once).")]
PROFILE_ENV = "PIPEINFER_PROFILE"
ProfileOption = Annotated[Path | None, typer.Option(
    "--profile", envvar=PROFILE_ENV, show_envvar=True, metavar="FILE",
    help="A profile written by `pipeinfer calibrate` with the same ranks, for --layer-split auto and -M auto (without "
         "one, they calibrate quickly at the start and cache the profile per machine, model and job shape). The "
         "head plans the job from it alone: only the first node needs it (as the model).")]
ThreadsOption = Annotated[str | None, typer.Option("--threads", "-t", help="Threads per rank: one value or one per rank (default: the CPUs the rank may use, from its cpuset and cgroup quota, / ranks on its host; all of them for each rank of an iterative `generate --ranks N`, where one stage computes at a time).")]
CtxOption = Annotated[int, typer.Option("--ctx", "-c", min=16, help="Context size (KV cells) per rank.")]
UbatchOption = Annotated[int | None, typer.Option(
    "--ubatch", "-ub", min=1, metavar="N", show_default=False,
    help="Compute the prompt in chunks of N tokens from its start, as llama.cpp's -ub batches it (512 there), so "
         "that the greedy tokens are llama.cpp's own: ggml rounds a chunk of another size differently. Default: "
         "chunks of 16, 16, 16, 16, 32, 32, 64, 64, 128, 128, then 256 tokens, which fill the pipeline's stages "
         "sooner (docs/modes.md). Every mode gives iterative's tokens at any N.")]
RankTimeoutOption = Annotated[float, typer.Option(
    "--rank-timeout", min=0, metavar="SECONDS",
    help="End the job with an error naming the rank when a rank sends nothing (heartbeats included), or "
         "computes without finishing a layer, for this long; or when nothing moves in the job for this long "
         "while the head waits (a lost message). One layer of one eval must finish within it. 0 disables.")]
NO_PULL_ENV = "PIPEINFER_NO_PULL"
NoPullOption = Annotated[bool, typer.Option(
    "--no-pull", envvar=NO_PULL_ENV, show_envvar=True,
    help="Never download: a registry model missing from the cache is an error (run `pipeinfer models pull` "
         f"first). Without it, a missing registry model is pulled on first use. Set {NO_PULL_ENV}=1 in batch "
         "and cluster jobs.")]

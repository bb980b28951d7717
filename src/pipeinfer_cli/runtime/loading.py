"""Loading what each rank holds for a job (`Loaded`): its layer engine, and on the head the
tokenizer, the tokenized prompts and a head-local drafter; on a draft rank, the draft model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..decode.session import DecodeOptions
from ..errors import UsageError
from ..planner.job_config import JobConfig
from .job_config import Request
from .loaded import Loaded
from ..planner.layout import RankPlan, Topology

if TYPE_CHECKING:
    from ..decode.drafters import Drafter
    from .tokenizer import Tokenizer


def spec_margin(mode: str, decode: DecodeOptions) -> int:
    """KV cells beyond prompt + -n that a mode may fill with these speculation settings:
    speculative runs in flight write past the last committed token (rejected cells are removed again)."""
    from ..decode.modes import get_mode

    return get_mode(mode).kv_margin(decode)


def n_predict_for(cfg: JobConfig, req: Request, n_prompt: int) -> int:
    """Tokens to generate: -n, or with -n -1 as many as the request's slot holds (until end of text)."""
    n = requested_n(cfg, req)
    if n > 0:
        return n
    return cfg.slot_ctx - n_prompt - spec_margin(req.mode, req.decode or cfg.decode)


def requested_n(cfg: JobConfig, req: Request) -> int:
    """The request's own -n if it has one, else the job's (-1: until the end of text)."""
    return cfg.decode.n_predict if req.n_predict is None else req.n_predict


def _warn_if_profiled_elsewhere(profile: Path | None, rank: int) -> None:
    """With --profile (for --layer-split auto or -M auto): one warning line from a rank that runs on
    another machine than the profile measured for it."""
    if profile is None or not Path(profile).is_file():
        return  # no profile, or the head's is not on this node
    import sys

    from ..planner.profile import Profile
    from .host_facts import host_facts

    facts = host_facts()
    warning = Profile.load(profile).machine_warning(rank, facts.host, facts.cpu, f"the profile {profile}")
    if warning:
        print(f"pipeinfer: warning: {warning}", file=sys.stderr, flush=True)


def make_drafter(cfg: JobConfig, threads: int) -> Drafter:
    from .draft_setup import local_drafter

    return local_drafter(cfg.draft, cfg.draft_path, cfg.n_ctx, threads)


def load_rank(cfg: JobConfig, topo: Topology, rank: int, requests: list[Request], needs_draft: bool,
              hosts: list[str] | None = None) -> Loaded:
    """hosts: every rank's host name (start-up's check-ins); None: this rank's host is its own."""
    from ..native import LayerEngine
    from ..transport.faults import slowdown_for

    me = topo.ranks[rank]
    out = Loaded(topo, me)
    _warn_if_profiled_elsewhere(cfg.profile, rank)
    check_memory_limit(cfg, topo, rank, hosts, needs_draft)
    if me.role == "draft":
        if needs_draft:
            out.drafter = make_drafter(cfg, me.threads)
        return out
    geometry = cfg.geometry  # sequences and cells per request slot
    try:
        out.engine = LayerEngine(str(cfg.model_path), me.layers[0], me.layers[1], n_ctx=geometry.n_ctx,
                                 n_threads=me.threads, n_seq_max=geometry.n_seq, n_slots=geometry.n_slots, slowdown=slowdown_for(rank))
    except RuntimeError as e:
        if "cannot allocate a KV cache" not in str(e):
            raise
        need = str(e).partition(": it needs ")[2] or "more than there is"
        raise UsageError(f"--ctx {cfg.n_ctx} is too large for this machine's memory: this rank's KV cache needs "
                         f"{need}; lower --ctx") from None
    if me.role == "head":
        _load_head(cfg, out, requests, needs_draft)
    return out


@dataclass(frozen=True)
class MemoryNeed:
    """What one rank copies into its memory for a job: `what` it holds, about `bytes` of it."""

    rank: int
    what: str
    bytes: int


def rank_memory_needs(cfg: JobConfig, topo: Topology, rank: int, needs_draft: bool) -> list[MemoryNeed]:
    """What rank `rank` holds: a stage its layers' weights (repacked into its memory; the LM head on
    the last stage; the embedding table stays in the file's pages) and their KV cache at the job's
    cells; the head also a draft model it runs itself, a draft rank its draft model (each with its
    weights and its own KV cache at --ctx)."""
    from ..models.gguf_info import read_model_info

    me, out = topo.ranks[rank], []
    if me.role != "draft":
        info = read_model_info(cfg.model_path)
        b, e = me.layers
        weights = sum(info.layer_bytes[b:e]) + (info.output_bytes if rank == topo.n_stages - 1 else 0)
        kv = info.kv_bytes_per_cell * (e - b) * cfg.engine_ctx  # every layer of the range
        out.append(MemoryNeed(rank, f"layers {b}-{e - 1} and their KV cache at --ctx {cfg.n_ctx}", weights + kv))
    draft_here = me.role == "draft" or (me.role == "head" and topo.draft_rank is None)
    if needs_draft and draft_here and cfg.draft_path is not None:
        # Its weights and its own KV cache at --ctx, counted from its header as the plan counts them
        # (planner/split.draft_model_bytes): this module reads the model's facts, it does not plan.
        d = read_model_info(Path(cfg.draft_path))
        out.append(MemoryNeed(rank, f"the draft model {cfg.draft_label} and its KV cache",
                              d.file_size + d.n_layer * cfg.n_ctx * d.kv_bytes_per_cell))
    return out


def host_memory_needs(cfg: JobConfig, topo: Topology, rank: int, hosts: list[str] | None,
                      needs_draft: bool) -> list[MemoryNeed]:
    """What every rank on rank `rank`'s host holds (they share its memory limit)."""
    here = [rank] if hosts is None else [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return [n for r in here for n in rank_memory_needs(cfg, topo, r, needs_draft)]


def check_memory_limit(cfg: JobConfig, topo: Topology, rank: int, hosts: list[str] | None,
                       needs_draft: bool) -> None:
    """Refuse, before loading, a rank whose host cannot hold what the job's ranks there load, within
    the memory limit its cgroup sets (a container's --memory, an emulated host's --mem, a Slurm
    job's), which every process on the host shares: otherwise the out-of-memory killer ends a rank
    half-way through loading, and the job can only say "killed". Counted: every rank of the host,
    each with what `rank_memory_needs` says it holds (a head-local or draft rank's draft model too)."""
    from .cpu_share import memory_limit_bytes

    limit = memory_limit_bytes()
    if limit is None:
        return
    needs = host_memory_needs(cfg, topo, rank, hosts, needs_draft)
    total = sum(n.bytes for n in needs)
    if total > limit:
        raise UsageError(memory_refusal(needs, limit, hosts[rank] if hosts else None, cfg.n_ctx))


def memory_refusal(needs: list[MemoryNeed], limit: int, host: str | None, n_ctx: int) -> str:
    """The one line that refuses a host whose ranks need more than its memory limit."""
    import socket

    from ..wording import human_bytes

    host = host or socket.gethostname()
    ranks = sorted({n.rank for n in needs})
    total = sum(n.bytes for n in needs)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    parts = "; ".join(f"rank {n.rank}: {n.what}, {human_bytes(n.bytes)}" for n in needs)
    together = "" if len(needs) == 1 else " together"
    fix = "split the model over more hosts (--ranks, or fewer ranks on this host)" if len(ranks) > 1 else \
        "split the model over more hosts (--ranks)"
    return (f"{who} (host {host}) need{'s' if len(ranks) == 1 else ''} about {human_bytes(total)}{together} "
            f"({parts}), but the host's memory limit is {human_bytes(limit)} (cgroup); {fix}, lower --ctx "
            f"(now {n_ctx}), or raise the host's memory limit")


def _load_head(cfg: JobConfig, out: Loaded, requests: list[Request], needs_draft: bool) -> None:
    from .tokenizer import Tokenizer

    tok = out.tokenizer = Tokenizer(cfg.model_path)
    out.prompts = [tokenize_request(cfg, tok, req) for req in requests]
    if not needs_draft:
        return
    if cfg.draft.is_none:
        raise UsageError("speculative and pipeinfer modes need a draft: pass --draft MODEL, --draft lookup, or a pair name")
    out.draft_vocab = "direct"  # lookup drafts in the target's own tokens
    if cfg.draft_path is not None:
        from .vocab import check_translatable, draft_vocab

        # From the draft's vocabulary alone, before its weights load, wherever it runs.
        draft_tok = Tokenizer(cfg.draft_path)
        out.draft_vocab = draft_vocab(tok, draft_tok)
        if out.draft_vocab == "translated":
            check_translatable(tok, draft_tok, cfg.model_label, cfg.draft_label)
            out.draft_tokenizer = draft_tok
        else:
            draft_tok.close()
    if out.topo.draft_rank is None:
        out.drafter = make_drafter(cfg, out.me.threads)


class PromptTooLongError(UsageError):
    """A prompt that, with the tokens to generate, does not fit the context (--ctx)."""

    def __init__(self, msg: str, n_prompt: int, need: int, n_ctx: int):
        super().__init__(msg)
        self.n_prompt, self.need, self.n_ctx = n_prompt, need, n_ctx  # tokens, KV cells needed, --ctx


def tokenize_request(cfg: JobConfig, tok: Tokenizer, req: Request) -> list[int]:
    """The request's prompt tokens; UsageError if empty, PromptTooLongError if it does not fit --ctx."""
    ids = tok.chat_messages(req.chat) if req.chat is not None else tok.encode(req.prompt or "")
    label = f"{req.label} " if req.label else ""
    if not ids:
        raise UsageError(f"prompt {label}is empty; pass text with -p, -f or --chat")
    n_predict = n_predict_for(cfg, req, len(ids))
    margin = spec_margin(req.mode, req.decode or cfg.decode)
    need = len(ids) + max(n_predict, 1) + margin
    if n_predict < 1 or need > cfg.n_ctx:
        n_req = requested_n(cfg, req)
        what = f"with -n {n_req}" if n_req > 0 else "with -n -1"
        spec = " and the cells of speculative runs in flight" if margin > 1 else ""
        fix = "lower -n, raise --ctx or shorten the prompt" if n_req > 0 else "raise --ctx or shorten the prompt"
        raise PromptTooLongError(f"prompt {label}has {len(ids)} tokens; {what}{spec} it needs {need} KV cells, "
                                 f"more than --ctx {cfg.n_ctx}; {fix}", len(ids), need, cfg.n_ctx)
    return ids

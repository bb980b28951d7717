"""Every drafter a job drafts with is built here, from the job's `DraftSpec` (`decode/draft_spec.py`).

On the rank that drafts (`local_drafter`): prompt lookup (`LookupDrafter`), suffix drafting
(`SuffixDrafter`) or a draft model (`LlamaDrafter`). On the head (`head_drafter`): that drafter or
a draft rank's proxy (`RemoteDrafter`), wrapped by what the job's draft needs: translation through
text when its vocabulary is not the target's (`decode/translated.py`; the draft rank itself only
ever sees its own tokens), and the model-free drafter in front of it with `--draft lookup+MODEL` or
`suffix+MODEL` (`decode/hybrid.py`). A request that drafts without the job's model (a per-request
lookup, a parallel slot while another holds the model) gets `lookup_drafter` or `fallback_drafter`.

Suffix drafting learns across the job's requests: the head's suffix drafter is built once per job
with the job's `SuffixCorpus` (`decode/suffix_corpus.py`), which `suffix_corpus` finds again so
that the head adds each finished request to it; a parallel slot's suffix drafter shares it. On a
draft rank ('/1') a suffix drafter has only the request's own tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..decode.draft_spec import DraftSpec
from ..decode.drafters import AsyncDrafter, Drafter, NoDraft
from ..decode.hybrid import HybridAsyncDrafter, HybridDrafter
from ..decode.lookup import LookupDrafter
from ..decode.suffix import SuffixDrafter
from ..decode.suffix_corpus import SuffixCorpus
from ..decode.translated import TranslatedAsyncDrafter, TranslatedDrafter
from ..transport.mpi_link import Link
from ..planner.job_config import JobConfig
from .remote_draft import RemoteDrafter

if TYPE_CHECKING:
    from .loaded import Loaded


def local_drafter(spec: DraftSpec, path: Path | None, n_ctx: int, threads: int) -> Drafter:
    """The drafter that runs on this rank: lookup for `lookup`, suffix drafting for `suffix` (with
    the job's corpus of earlier requests on the head: `head_drafter` gives it one), else the draft
    model at `path` (behind the model-free drafter with `lookup+MODEL` or `suffix+MODEL`, the head
    adds that: `head_drafter`)."""
    if spec.is_lookup:
        return LookupDrafter()
    if spec.is_suffix:
        return SuffixDrafter()
    from ..decode.drafters import LlamaDrafter

    return LlamaDrafter(Path(path), n_ctx=n_ctx, n_threads=threads)


def lookup_drafter() -> LookupDrafter:
    """Prompt lookup for one request (stateless: every request may have its own)."""
    return LookupDrafter()


def suffix_drafter(corpus: SuffixCorpus | None) -> SuffixDrafter:
    """Suffix drafting for one request, sharing the job's corpus of earlier requests."""
    return SuffixDrafter(corpus)


def suffix_corpus(drafter: Drafter | AsyncDrafter | None) -> SuffixCorpus | None:
    """The job's corpus of earlier requests, when the head's drafter drafts by suffix (alone or in
    front of a model); None otherwise."""
    if isinstance(drafter, (HybridDrafter, HybridAsyncDrafter)):
        drafter = drafter.front
    return drafter.corpus if isinstance(drafter, SuffixDrafter) else None


def fallback_drafter(spec: DraftSpec, corpus: SuffixCorpus | None = None) -> Drafter:
    """What a request drafts with while another holds the job's draft model: the model-free drafter
    the draft has in front of the model (`lookup+MODEL`, `suffix+MODEL`: with the job's corpus),
    else nothing."""
    if spec.uses_suffix:
        return SuffixDrafter(corpus)
    return LookupDrafter() if spec.uses_lookup else NoDraft()


def head_drafter(cfg: JobConfig, loaded: Loaded, link: Link) -> Drafter | AsyncDrafter | None:
    """The head's drafter from what the job loaded (a `loading.Loaded`), or None without a draft."""
    topo = loaded.topo
    remote = topo.draft_rank is not None
    drafter = RemoteDrafter(link, topo.draft_rank) if remote else loaded.drafter
    if drafter is None:
        return None
    if isinstance(drafter, SuffixDrafter) and drafter.corpus is None:
        drafter.corpus = SuffixCorpus()  # one per job: the head's drafter is built once
    if loaded.draft_vocab == "translated":
        wrap = TranslatedAsyncDrafter if remote else TranslatedDrafter
        drafter = wrap(drafter, loaded.tokenizer, loaded.draft_tokenizer, cfg.n_ctx,
                       map_alternatives=cfg.decode.max_branches > 1)
    if cfg.draft.is_hybrid:
        front = SuffixDrafter(SuffixCorpus()) if cfg.draft.uses_suffix else LookupDrafter()
        drafter = (HybridAsyncDrafter if remote else HybridDrafter)(drafter, front)
    return drafter

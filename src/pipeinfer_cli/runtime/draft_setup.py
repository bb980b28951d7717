"""Every drafter a job drafts with is built here, from the job's `DraftSpec` (`decode/draft_spec.py`).

On the rank that drafts (`local_drafter`): prompt lookup (`LookupDrafter`) or a draft model
(`LlamaDrafter`). On the head (`head_drafter`): that drafter or a draft rank's proxy
(`RemoteDrafter`), wrapped by what the job's draft needs: translation through text when its
vocabulary is not the target's (`decode/translated.py`; the draft rank itself only ever sees its own
tokens), and prompt lookup in front of it with `--draft lookup+MODEL` (`decode/hybrid.py`). A
request that drafts without the job's model (a per-request lookup, a parallel slot while another
holds the model) gets `lookup_drafter` or `fallback_drafter`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..decode.draft_spec import DraftSpec
from ..decode.drafters import AsyncDrafter, Drafter, NoDraft
from ..decode.hybrid import HybridAsyncDrafter, HybridDrafter
from ..decode.lookup import LookupDrafter
from ..decode.translated import TranslatedAsyncDrafter, TranslatedDrafter
from ..transport.mpi_link import Link
from .job_config import JobConfig
from .remote_draft import RemoteDrafter

if TYPE_CHECKING:
    from .loaded import Loaded


def local_drafter(spec: DraftSpec, path: Path | None, n_ctx: int, threads: int) -> Drafter:
    """The drafter that runs on this rank: lookup for `lookup`, else the draft model at `path`
    (behind lookup with `lookup+MODEL`, the head adds that: `head_drafter`)."""
    if spec.is_lookup:
        return LookupDrafter()
    from ..decode.drafters import LlamaDrafter

    return LlamaDrafter(Path(path), n_ctx=n_ctx, n_threads=threads)


def lookup_drafter() -> LookupDrafter:
    """Prompt lookup for one request (stateless: every request may have its own)."""
    return LookupDrafter()


def fallback_drafter(spec: DraftSpec) -> Drafter:
    """What a request drafts with while another holds the job's draft model: lookup when the
    draft has it in front of the model (`lookup+MODEL`), else nothing."""
    return LookupDrafter() if spec.uses_lookup else NoDraft()


def head_drafter(cfg: JobConfig, loaded: Loaded, link: Link) -> Drafter | AsyncDrafter | None:
    """The head's drafter from what the job loaded (a `loading.Loaded`), or None without a draft."""
    topo = loaded.topo
    remote = topo.draft_rank is not None
    drafter = RemoteDrafter(link, topo.draft_rank) if remote else loaded.drafter
    if drafter is None:
        return None
    if loaded.draft_vocab == "translated":
        wrap = TranslatedAsyncDrafter if remote else TranslatedDrafter
        drafter = wrap(drafter, loaded.tokenizer, loaded.draft_tokenizer, cfg.n_ctx,
                       map_alternatives=cfg.decode.max_branches > 1)
    if cfg.draft.is_hybrid:
        drafter = (HybridAsyncDrafter if remote else HybridDrafter)(drafter)
    return drafter

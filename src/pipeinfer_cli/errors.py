"""Typed errors. Raised deep in the library, reported once by the CLI as a one-line `Error: …`."""


class PipeinferError(Exception):
    """Base class: the message is shown to the user as is, so it names the problem and the fix."""

    exit_code = 1


class RegistryError(PipeinferError):
    """models.toml is malformed, or a model / pair name is unknown."""


class ModelFileError(PipeinferError):
    """A model path is missing, is not a GGUF file, or is truncated."""


class DownloadError(PipeinferError):
    """A model could not be fetched, assembled or verified."""


class CacheError(PipeinferError):
    """The model cache directory cannot be used."""


class UsageError(PipeinferError):
    """A combination of options that cannot work."""


class OptionValueError(UsageError):
    """An option's value is out of its range (exit status 2, like any command-line usage error)."""

    exit_code = 2

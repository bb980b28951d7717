"""Typed errors. Raised deep in the library, reported once by the CLI as a one-line `Error: …`.

This module also owns the one way an error is worded: `describe()` for an exception (on any rank),
`error_line()` for the line the user sees, and `debug_enabled()` for PIPEINFER_DEBUG.
"""

import os
import traceback

DEBUG_ENV = "PIPEINFER_DEBUG"


def debug_enabled() -> bool:
    """PIPEINFER_DEBUG=1: full tracebacks, and the launcher's own output left unfiltered."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe(exc: BaseException, traceback_too: bool = False) -> str:
    """What to tell the user about exc: a typed error's own message; anything else is a bug."""
    if isinstance(exc, PipeinferError):
        msg = str(exc)
    else:
        msg = f"internal error: {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for a traceback)"
    if traceback_too:
        msg += "\n" + "".join(traceback.format_exception(exc)).rstrip()
    return msg


def error_line(msg: str) -> str:
    return f"Error: {msg}"


def illegal_instruction(who: str = "a rank") -> str:
    """Why a process died of SIGILL, and the fix: ggml was built for instructions this CPU does not
    run (typically `-march=native` AMX kernels on a machine whose hypervisor does not enable AMX)."""
    return (f"{who} died of SIGILL (illegal instruction): llama-cpp-python's ggml, which the native engine "
            "shares, was built with instructions this CPU does not run (ggml's AMX kernels, where AMX is "
            "reported but not enabled, as in some VMs); rebuild it portable with "
            "`PIPEINFER_GGML_PORTABLE=1 make install` in the pipeinfer checkout")


class PipeinferError(Exception):
    """Base class: the message is shown to the user as is, so it names the problem and the fix."""

    exit_code = 1


class RegistryError(PipeinferError):
    """models.toml is malformed, or a model / pair name is unknown."""


class UnknownModelError(RegistryError):
    """A model name that is neither in the registry nor a path: a usage error (exit status 2)."""

    exit_code = 2


class ModelFileError(PipeinferError):
    """A model path is missing, is not a GGUF file, or is truncated."""


class DownloadError(PipeinferError):
    """A model could not be fetched, assembled or verified."""


class CacheError(PipeinferError):
    """The model cache directory cannot be used."""


class GgmlCpuError(PipeinferError):
    """ggml's CPU backend cannot be loaded: PIPEINFER_GGML_CPU names a variant that is not installed
    or that this CPU does not run, or no installed variant runs here."""


class UsageError(PipeinferError):
    """A combination of options that cannot work (exit status 2, like any command-line usage error)."""

    exit_code = 2


class OptionValueError(UsageError):
    """An option's value is out of its range."""

"""pipeinfer: single-request LLM generation across CPU ranks with asynchronous pipelined speculation."""

__version__ = "0.1.0"

import os as _os

# `make asan`: load the native extension built with AddressSanitizer (build/native-asan) instead of
# the one installed next to this file, without touching that one.
if _os.environ.get("PIPEINFER_NATIVE_DIR"):
    __path__.insert(0, _os.environ["PIPEINFER_NATIVE_DIR"])

"""pipeinfer: single-request LLM generation across CPU ranks with asynchronous pipelined speculation."""

__version__ = "0.1.0"

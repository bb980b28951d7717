"""The target model's tokenizer and chat template, through llama.cpp (vocab-only load, no weights)."""

from __future__ import annotations

import codecs
from pathlib import Path

from ..errors import UsageError


class Tokenizer:
    """Tokenize prompts, apply the model's chat template, and detokenize a stream of tokens."""

    def __init__(self, model_path: Path):
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr

        self._llama_cpp = llama_cpp
        # A vocab-only context warns about n_ctx_train = 0 straight to fd 2; it means nothing here.
        with suppress_stdout_stderr(disable=False):
            self.llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False, n_ctx=1)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = self.llm.n_vocab()
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.metadata = self.llm.metadata

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        bos = self.add_bos if add_bos is None else add_bos
        return self.llm.tokenize(text.encode(), add_bos=bos, special=True)

    def chat_messages(self, messages: list[dict]) -> list[int]:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.metadata.get("tokenizer.chat_template")
        if not template:
            raise UsageError("this model has no chat template in its GGUF metadata; use -p/--prompt with raw text instead of --chat")
        eos = self.llm._model.token_get_text(self.llm.token_eos()) if self.llm.token_eos() >= 0 else ""
        bos = self.llm._model.token_get_text(self.llm.token_bos()) if self.llm.token_bos() >= 0 else ""
        fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
        text = fmt(messages=messages).prompt
        # The template already writes BOS when the model wants it.
        return self.encode(text, add_bos=self.add_bos and not (bos and text.startswith(bos)))

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry of a token id (to compare two vocabularies)."""
        return self._llama_cpp.llama_vocab_get_text(self.vocab, token)

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def piece(self, token: int) -> bytes:
        return self.llm.detokenize([token])

    def decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they are committed, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self.tok.piece(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

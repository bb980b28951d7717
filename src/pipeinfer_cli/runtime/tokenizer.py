"""The target model's tokenizer and chat template, through llama.cpp (vocab-only load, no weights)."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
from pathlib import Path

from ..errors import ModelFileError, UsageError



class NoChatTemplateError(UsageError):
    """Chat messages for a model whose GGUF has no chat template. The message speaks the CLI's
    options; another front end (the server) words its own from the type."""

    def __init__(self):
        super().__init__("this model has no chat template in its GGUF metadata; use -p/--prompt with raw text instead "
                         "of --chat")

class Tokenizer:
    """Tokenize prompts, apply the model's chat template, and detokenize a stream of tokens."""

    def __init__(self, model_path: Path):
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr

        from ..native import ggml_cpu

        self._llama_cpp = llama_cpp
        _check_vocabulary(model_path)
        ggml_cpu()  # llama.cpp computes with the CPU backend registered; a per-variant ggml has none yet
        # A vocab-only context warns about n_ctx_train = 0 straight to fd 2; it means nothing here.
        with suppress_stdout_stderr(disable=False), _llama_errors() as errors:
            try:
                self.llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False, n_ctx=1)
            except ValueError:  # llama-cpp-python's "Failed to load model"; llama.cpp logged why
                reason = _load_failure_reason(errors)
                raise ModelFileError(f"{model_path}: llama.cpp cannot load its vocabulary ({reason}); "
                                     "the file is corrupted or not a supported model") from None
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        _check_special_tokens(model_path, self.vocab)
        self.n_vocab = self.llm.n_vocab()
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.metadata = self.llm.metadata
        self.path = model_path

    def close(self) -> None:
        """Free llama.cpp's vocabulary now: one still open at interpreter exit is freed after the
        bindings are gone, and Python prints 'Exception ignored' to stderr."""
        self.llm.close()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        bos = self.add_bos if add_bos is None else add_bos
        ids = self.llm.tokenize(text.encode(), add_bos=bos, special=True)
        # A vocabulary without a valid unknown token spells text it has no token for as -1
        # (RWKV, WPM, UGM); detokenizing that id aborts the process inside llama.cpp.
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise ModelFileError(f"{self.path}: its tokenizer turned the text into token id {bad}, outside its "
                                 f"vocabulary of {self.n_vocab} (tokenizer.ggml.unknown_token_id is missing or out "
                                 "of range); the file is corrupted")
        return ids

    def chat_messages(self, messages: list[dict]) -> list[int]:
        template = self.metadata.get("tokenizer.chat_template")
        if not template:
            raise NoChatTemplateError()
        eos = self.llm._model.token_get_text(self.llm.token_eos()) if self.llm.token_eos() >= 0 else ""
        bos = self.llm._model.token_get_text(self.llm.token_bos()) if self.llm.token_bos() >= 0 else ""
        text = _render_chat(self.path, template, messages, eos, bos)
        # The template already writes BOS when the model wants it.
        return self.encode(text, add_bos=self.add_bos and not (bos and text.startswith(bos)))

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry of a token id (to compare two vocabularies)."""
        return self._llama_cpp.llama_vocab_get_text(self.vocab, token)

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def piece(self, token: int) -> bytes:
        return self.llm.detokenize([token])

    # -- text as bytes, special tokens spelled out (translating a draft of another vocabulary) --
    @property
    def bos(self) -> int:
        return int(self.llm.token_bos())

    def encode_bytes(self, text: bytes, add_bos: bool) -> list[int]:
        """Token ids of UTF-8 text; special tokens' spellings (`<|im_end|>`) become those tokens."""
        return self.llm.tokenize(text, add_bos=add_bos, special=True)

    def text_piece(self, token: int) -> bytes:
        """A token's bytes, a special token's spelling included (`piece` gives b'' for those), so
        that the pieces of a tokenization spell the text it came from."""
        cache = self.__dict__.setdefault("_text_pieces", {})
        got = cache.get(token)
        if got is None:
            buf = ctypes.create_string_buffer(256)
            n = self._llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            got = cache[token] = buf.raw[:max(n, 0)]
        return got

    def decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


def _render_chat(model_path: Path, template: str, messages: list[dict], eos: str, bos: str) -> str:
    """The messages through the model's Jinja chat template (sandboxed by llama-cpp-python).

    The template is code from the model file: a template that refuses the messages on purpose
    (`raise_exception(...)`, e.g. roles that do not alternate) is a usage error; one that fails
    in any other way (syntax, undefined names, a division by zero, endless recursion) is the
    file's fault."""
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
        return fmt(messages=messages).prompt
    except ValueError as e:  # what the template's raise_exception() raises (llama-cpp-python)
        raise UsageError(f"the model's chat template refuses these messages: {e}") from None
    except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, AttributeError, RecursionError) as e:
        raise ModelFileError(f"{model_path}: its chat template fails ({type(e).__name__}: {e}); "
                             "use -p/--prompt with raw text instead") from None


def _check_vocabulary(model_path: Path) -> None:
    """Refuse what llama.cpp's vocabulary loader would abort the process on (GGML_ASSERT)."""
    from .. import _native

    try:
        problem = _native.gguf_vocab_problem(str(model_path))
    except _native.ModelFileError as e:
        raise ModelFileError(f"{e}; the file is corrupted or not a GGUF model") from None
    if problem:
        raise ModelFileError(f"{model_path}: its vocabulary cannot be used: {problem}; the file is corrupted")
    _check_chat_templates(model_path)


def _check_special_tokens(model_path: Path, vocab) -> None:
    """llama.cpp aborts the process (GGML_ASSERT) when it tokenizes with special tokens that the
    vocabulary asks for but does not have (an id out of range becomes no token): refuse such a file
    once it is loaded, before any prompt is tokenized."""
    import llama_cpp

    null = llama_cpp.LLAMA_TOKEN_NULL
    wpm = llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_WPM  # always adds CLS and SEP
    needs = [("BOS", "tokenizer.ggml.bos_token_id", llama_cpp.llama_vocab_bos,
              wpm or llama_cpp.llama_vocab_get_add_bos(vocab)),
             ("EOS", "tokenizer.ggml.eos_token_id", llama_cpp.llama_vocab_eos, llama_cpp.llama_vocab_get_add_eos(vocab)),
             ("SEP", "tokenizer.ggml.seperator_token_id", llama_cpp.llama_vocab_sep, wpm)]
    for name, key, get, needed in needs:
        if needed and get(vocab) == null:
            raise ModelFileError(f"{model_path}: its vocabulary adds a {name} token to every prompt but has no valid "
                                 f"{name} token ({key} is missing or out of range); the file is corrupted")


def _check_chat_templates(model_path: Path) -> None:
    """llama-cpp-python compiles every chat template of the file while it loads the vocabulary, and
    lets a template's syntax error escape: compile them here first, to name the problem."""
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from .. import _native

    kv = _native.gguf_metadata(str(model_path))["kv"]
    for key, template in kv.items():
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
            try:
                Jinja2ChatFormatter(template=str(template), eos_token="", bos_token="")
            except (jinja2.TemplateError, RecursionError, ValueError) as e:
                raise ModelFileError(f"{model_path}: its chat template ({key}) does not compile "
                                     f"({type(e).__name__}: {e}); the file is corrupted") from None


@contextlib.contextmanager
def _llama_errors():
    """Collects llama.cpp's error log lines (why a load failed) while the block runs."""
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, _user_data):
        if level == 4:  # GGML_LOG_LEVEL_ERROR (llama_cpp._logger's table predates ggml's renumbering)
            line = text.decode("utf-8", "replace").strip()
            if line:
                lines.append(line)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _load_failure_reason(lines: list[str]) -> str:
    """The line of llama.cpp's error log that says why (its other lines only say that it failed)."""
    marker = "error loading model: "
    for line in lines:
        if marker in line:
            return line.split(marker, 1)[1]
    return lines[0] if lines else "no reason given"


class StreamDecoder:
    """Turns tokens into text as they are committed, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self.tok.piece(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

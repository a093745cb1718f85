"""Grammar compilation (xgrammar): ``GrammarSpec`` -> a compiled grammar, cached, off the caller.

``GrammarCompiler(tokenizer, vocab_size, stop_token_ids)`` compiles in a small thread pool:
``compile_async(spec)`` returns a future (the same one for a spec already compiled or being
compiled: a cache of ``max_cached`` grammars, least recently used first out); ``compile(spec)``
waits for it at most ``timeout_s`` seconds. Whatever cannot be compiled raises ``ValueError``
naming the request field (``origin``) and the backend's reason; a compile that runs past the
limit raises too (it finishes in the background and is cached).

``grammar_compiler(model_path, vocab_size)`` is the process's one compiler of a model: the
engine and an in-process rank share it, so a grammar is compiled once per process. The EOS ids
are the grammar's stop tokens: a grammar may end only where it allows EOS, and EOS is allowed
only where it may end.

Why xgrammar: its masks come from a per-grammar cache of token-mask sets, so filling a row's
mask takes microseconds on the host while the device runs the forward pass; its wheels are
small (Python 3.11/3.12, x86 and ARM) and its JSON schema coverage is the widest we measured.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from nvray.structured_outputs import GrammarSpec

if TYPE_CHECKING:  # torch loads where masks are made (the ranks), not where grammars compile
    import torch

DEFAULT_COMPILE_TIMEOUT_S = 30.0  # a grammar that takes longer is refused (NVRAY_GRAMMAR_TIMEOUT_S)
MAX_CACHED_GRAMMARS = 64


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = MAX_CACHED_GRAMMARS,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - loaded with the first grammar (~1 s)

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        self.tokenizer_info = info
        self._backend = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="nvray-grammar")
        self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.timeout_s = timeout_s

    def compile_async(self, spec: GrammarSpec) -> concurrent.futures.Future:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec, origin: str = "structured_outputs") -> Any:
        """The compiled grammar; ValueError if the spec can't be compiled in time."""
        future = self.compile_async(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"{origin}: compiling the {kind_name(spec[0])} took longer than "
                             f"{self.timeout_s:g} s") from None
        except ValueError as e:
            raise ValueError(f"{origin}: {e}") from None

    def _compile(self, spec: GrammarSpec) -> Any:
        kind, source = spec
        backend = self._backend
        try:
            if kind in ("json", "json_loose"):
                return backend.compile_json_schema(source, any_whitespace=False,
                                                   strict_mode=kind == "json")
            if kind == "json_object":  # OpenAI's JSON mode: an object (not any JSON value)
                return backend.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                   strict_mode=False)
            if kind == "regex":
                return backend.compile_regex(source)
            if kind == "ebnf":
                return backend.compile_grammar(source)
            if kind == "structural_tag":
                return backend.compile_structural_tag(source)
        except (RuntimeError, ValueError) as e:  # the backend's message: the reason, after its source line
            with self._lock:
                self._cache.pop(spec, None)  # not cached: the next try gets the same error
            raise ValueError(f"the {kind_name(kind)} is not supported: "
                             f"{backend_reason(e)}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    @functools.cached_property
    def json_safe_bitmask(self) -> torch.Tensor:
        """Bitmask [words] (int32) of the tokens without a control character (bytes 0-31).

        xgrammar's JSON grammars let a string hold raw control characters, which JSON forbids
        (``json.loads`` and ``JSON.parse`` refuse them); our JSON has no whitespace but spaces
        outside strings (compact), so JSON rows also AND this mask: escaped forms stay allowed."""
        info = self.tokenizer_info
        ok = np.zeros(((self.vocab_size + 31) // 32) * 32, dtype=bool)
        special = set(info.special_token_ids)
        for token_id, piece in enumerate(info.decoded_vocab[:self.vocab_size]):
            ok[token_id] = token_id in special or not any(b < 32 for b in piece)
        weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))
        words = (ok.reshape(-1, 32).astype(np.uint64) * weights).sum(axis=1).astype(np.uint32)
        import torch  # noqa: PLC0415

        return torch.from_numpy(words.view(np.int32).copy())


def kind_name(kind: str) -> str:
    return {"json": "JSON schema", "json_loose": "JSON schema", "json_object": "JSON grammar",
            "regex": "regex", "ebnf": "grammar",
            "structural_tag": "structural tag"}.get(kind, kind)


def backend_reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    for marker in ("Check failed: (error.empty()) is false: ", ".cc:"):
        if marker in text:
            text = text.split(marker, 1)[1]
            if marker == ".cc:":
                text = text.split(": ", 1)[-1]
    return text.strip()


_compilers_lock = threading.Lock()


def grammar_compiler(model_path: str, vocab_size: int) -> GrammarCompiler:
    """The process's compiler for the model at ``model_path`` (tokenizer and EOS ids from it),
    made once: a caller arriving while another thread makes it waits for that one (making it
    reads the whole vocabulary: ~10 s for Qwen3's 151,669 tokens on an H100 host)."""
    with _compilers_lock:
        return _new_grammar_compiler(model_path, vocab_size)


@functools.lru_cache(maxsize=4)
def _new_grammar_compiler(model_path: str, vocab_size: int) -> GrammarCompiler:
    from nvray.tokenizer import eos_token_ids, load_hf_tokenizer  # noqa: PLC0415

    tokenizer = load_hf_tokenizer(model_path)  # xgrammar reads transformers' tokenizers
    timeout = float(os.environ.get("NVRAY_GRAMMAR_TIMEOUT_S", DEFAULT_COMPILE_TIMEOUT_S))
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids(model_path, tokenizer),
                           timeout_s=timeout)

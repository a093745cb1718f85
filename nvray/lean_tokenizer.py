"""LeanTokenizer: a checkpoint's tokenizer from ``tokenizer.json``, without transformers.

The engine needs four things of a tokenizer: encode text, decode ids, its special tokens and
the chat template. The tokenizers library (Rust) does the first two from ``tokenizer.json``;
``tokenizer_config.json`` names the special tokens; the template is rendered here with jinja2 the
way transformers' ``apply_chat_template`` renders it (a sandbox, ``trim_blocks`` and
``lstrip_blocks``, loop controls, the ``{% generation %}`` tag, and the globals and filters
Hub templates call: ``raise_exception``, ``strftime_now``, ``tojson``, ``dict``, ``namespace``).
Loading it takes a fraction of a second; importing transformers (and the torch it pulls in)
took 10-12 s of an engine driver's start on an H100 host.

What transformers' tokenizer (the oracle in the tests) and this one agree on, for the same
files (transformers 5's rules): ``encode(text, add_special_tokens=...)``,
``decode(ids, skip_special_tokens=...)``, ``apply_chat_template(messages, tools=...,
add_generation_prompt=..., tokenize=..., **vars)``, ``eos_token_id``, ``all_special_ids``,
``special_tokens_map``. It covers byte-level BPE tokenizers (``byte_level``: Qwen's, Llama 3's,
GPT-2's), which transformers runs from tokenizer.json as they stand; ``nvray.tokenizer`` loads
any other (Llama 2's SentencePiece-derived ones, which transformers rebuilds from its own classes,
or a checkpoint without tokenizer.json) through transformers.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import glob
import json
import os
from collections.abc import Mapping
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class LeanTokenizer:
    """Encode, decode and chat-render with the files of one checkpoint directory."""

    def __init__(self, model_path: str) -> None:
        from tokenizers import Tokenizer  # noqa: PLC0415

        backend = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        backend.no_truncation()  # a saved truncation or padding would apply to every encode
        backend.no_padding()
        config = _read_json(os.path.join(model_path, "tokenizer_config.json"))
        if "added_tokens_decoder" not in config:  # older layouts: special_tokens_map.json wins
            config.update(_read_json(os.path.join(model_path, "special_tokens_map.json")))
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.backend_tokenizer = backend
        self.byte_level = _is_byte_level(backend)
        self.special_tokens_map = _named_special_tokens(config)
        specials = [*self.special_tokens_map.values(), *_extra_special_tokens(config)]
        _mark_special(backend, specials)
        ids = (backend.token_to_id(t) for t in dict.fromkeys(specials))
        self.all_special_ids = [i for i in ids if i is not None]
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos else None
        self.chat_template = _chat_template(model_path, config.get("chat_template"))
        # transformers skips this clean-up for BPE models (Qwen's, Llama's), whose text it corrupts
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces")) \
            and type(backend.model).__name__ != "BPE"

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """The conversation rendered by the model's template (``chat_template``: another
        template, or the name of one of the model's); token ids if ``tokenize``. ``kwargs`` are
        template variables (e.g. ``enable_thinking``); a template's ``raise_exception`` raises
        ``jinja2.TemplateError``."""
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        template = _compiled_template(self._template_source(chat_template, tools))
        variables = _plain({**self.special_tokens_map, **kwargs})
        messages = _with_reasoning_aliases(_plain([{k: v for k, v in dict(m).items()
                                                    if v is not None} for m in conversation]))
        text = template.render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_source(self, chat_template: str | None, tools: Any) -> str:
        """The template to render: ``chat_template`` itself, or the model's (by name when it
        has several: "tool_use" with tools, else "default")."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError("the model has several chat templates and none named 'default': "
                             f"pass one of {sorted(templates)} as chat_template")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("the model has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template)")
        return templates


def _named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens, as transformers 5 names them: the standard ones, any other
    ``*_token`` key (a model's own, e.g. ``image_token``) and a dict ``extra_special_tokens``."""
    named = {key: text for key, value in config.items()
             if key.endswith("_token") and (text := _token_text(value)) is not None}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named.update({key: text for key, value in extra.items()
                      if (text := _token_text(value)) is not None})
    return named


def _extra_special_tokens(config: dict[str, Any]) -> list[str]:
    """The unnamed special tokens: ``extra_special_tokens`` as a list (transformers 5), else
    ``additional_special_tokens`` (older files)."""
    tokens = config.get("extra_special_tokens")
    if not isinstance(tokens, (list, tuple)):
        tokens = config.get("additional_special_tokens") or ()
    return [text for t in tokens if (text := _token_text(t))]


def _mark_special(backend: Any, specials: list[str]) -> None:
    """Flag the config's special tokens special in the backend too (``skip_special_tokens``
    drops them), as transformers does, keeping how each one matches text."""
    from tokenizers import AddedToken  # noqa: PLC0415

    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    unflagged = [t for t in dict.fromkeys(specials) if backend.token_to_id(t) is not None
                 and not (t in added and added[t].special)]
    backend.add_special_tokens([
        AddedToken(t, single_word=added[t].single_word, lstrip=added[t].lstrip,
                   rstrip=added[t].rstrip, normalized=added[t].normalized, special=True)
        if t in added else AddedToken(t, normalized=False, special=True) for t in unflagged])


def _is_byte_level(backend: Any) -> bool:
    """Whether the tokenizer maps bytes through a ByteLevel pre-tokenizer (GPT-2's scheme: Qwen,
    Llama 3). transformers rebuilds some other tokenizers (Llama 2's SentencePiece-derived ones)
    from its own classes instead of using tokenizer.json as it stands."""
    component = backend.pre_tokenizer
    return component is not None and b'"ByteLevel"' in component.__getstate__()


# what transformers' clean_up_tokenization removes, in its order: the space a word-piece decoder
# leaves before punctuation and English contractions
_SPACE_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _clean_up_spaces(text: str) -> str:
    for old, new in _SPACE_CLEAN_UPS:
        text = text.replace(old, new)
    return text


def _chat_template(model_path: str, configured: Any) -> str | dict[str, str] | None:
    """The model's template, or its templates by name: chat_template.jinja (the main one,
    "default" when there are others) and additional_chat_templates/*.jinja; without those files,
    tokenizer_config.json's ``chat_template`` (a string, or a list of {name, template})."""
    main = os.path.join(model_path, "chat_template.jinja")
    named = sorted(glob.glob(os.path.join(model_path, "additional_chat_templates", "*.jinja")))
    if named:
        files = [(main, "default")] if os.path.exists(main) else []
        return {name: _read_text(path) for path, name in
                files + [(p, os.path.basename(p)[:-len(".jinja")]) for p in named]}
    if os.path.exists(main):
        return _read_text(main)
    if isinstance(configured, list):
        return {t["name"]: t["template"] for t in configured}
    return configured if isinstance(configured, str) else None


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON-like data (dicts, lists, tuples, str, numbers, bools,
    None); subclasses (enums, named tuples, numpy scalars) lose their methods, pydantic models
    and dataclasses become dicts, anything else a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a str enum's value, not its name
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())  # a numpy scalar (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under every name templates read it by (``reasoning_content``,
    ``thinking``), whichever of them the caller used."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None
                   else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> Any:
    return _jinja_environment().from_string(source)


def _generation_tag(jinja2: Any) -> Any:
    """The jinja2 extension of transformers' ``{% generation %}`` tag."""

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training
        masks; rendering keeps its body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag


def _safe_namespace(jinja2: Any) -> Any:
    """jinja2's ``namespace`` refusing underscore names."""

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore names (no way into Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the underscore attribute {name!r}")

    return Namespace


def _jinja_environment() -> Any:
    """A sandboxed jinja2 environment with what Hub chat templates expect of transformers."""
    import jinja2  # noqa: PLC0415
    import jinja2.ext  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older sandboxes can be escaped); "
                          f"this is {jinja2.__version__}")

    GenerationTag, Namespace = _generation_tag(jinja2), _safe_namespace(jinja2)

    class DictFactory:
        """``dict(...)`` and ``dict.fromkeys(...)``, nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which no model was trained on
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace, dict=DictFactory(),
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env

"""Structured outputs: what a request's text must match, as users state it, checked and made
into the one ``GrammarSpec`` the engine and the ranks compile.

``StructuredOutputsParams`` holds exactly one constraint (vLLM's names):

- ``json``: a JSON schema (a dict, or its JSON text); ``strict`` (default True) forbids what the
  schema does not list (extra properties, extra array items), as OpenAI's strict mode does;
- ``json_object``: any JSON object;
- ``regex``: a regular expression the whole output matches;
- ``choice``: the output is one of these strings;
- ``grammar``: an EBNF grammar (xgrammar's dialect of GBNF, the start rule ``root``);
- ``structural_tag``: an xgrammar structural tag (a dict or its JSON text): free text with
  constrained parts, e.g. tool calls (``deployments/apis/tools.py`` builds them).

``spec()`` gives the ``GrammarSpec`` — ``(kind, source)``, plain strings, canonical (a schema is
re-serialized with sorted keys, a choice becomes a grammar), so equal constraints share one
compiled grammar. JSON is generated compact: no whitespace outside strings beyond what the
format needs.

JSON schema keywords that the grammar backend would silently ignore are refused with a
``ValueError`` naming the keyword and where it is (``not``, ``if``/``then``/``else``,
``contains``, ``allOf`` with more than one schema, a ``$ref`` outside the document), so an
accepted schema is one the output really follows. ``origin`` names the request field the
constraint came from (``response_format.json_schema``, ``guided_regex``...) in every error.

``ResponseFormat`` is OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``),
as the HTTP API and the batch job's rows take it; ``constraint()`` makes it one of the above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

GrammarSpec = tuple[str, str]  # (kind, source): kind in GRAMMAR_KINDS
GRAMMAR_KINDS = ("json", "json_loose", "json_object", "regex", "ebnf", "structural_tag")

# keywords the backend (xgrammar 0.2) accepts but does not enforce
_UNENFORCED = {"not": "negation", "if": "conditionals", "then": "conditionals",
               "else": "conditionals", "contains": "array contains",
               "minContains": "array contains", "maxContains": "array contains"}
_DATA_KEYWORDS = {"enum", "const", "default", "examples"}  # values, not schemas
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    strict: bool = True
    origin: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(f"{self.origin}: give exactly one of json, json_object, regex, "
                             f"choice, grammar, structural_tag (got {given or 'none'})")

    @classmethod
    def coerce(cls, value: Any, origin: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a StructuredOutputsParams or a dict of its fields (unknown keys name themselves)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{origin} must be an object, got {type(value).__name__}")
        allowed = {"json", "json_object", "regex", "choice", "grammar", "structural_tag",
                   "strict"}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**value, origin=origin)

    def spec(self) -> GrammarSpec:
        """The canonical (kind, source); raises ValueError naming what is wrong."""
        if self.json is not None:
            return ("json" if self.strict else "json_loose", canonical_schema(self.json,
                                                                              self.origin))
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            _require(isinstance(self.regex, str) and self.regex != "", self.origin,
                     "regex must be a non-empty string")
            return ("regex", self.regex)
        if self.choice is not None:
            return ("ebnf", choice_grammar(self.choice, self.origin))
        if self.structural_tag is not None:
            tag = self.structural_tag
            return ("structural_tag", tag if isinstance(tag, str)
                    else json.dumps(tag, separators=(",", ":"), ensure_ascii=False))
        _require(isinstance(self.grammar, str) and self.grammar.strip() != "", self.origin,
                 "grammar must be a non-empty EBNF string")
        return ("ebnf", self.grammar)  # type: ignore[return-value]


def _require(ok: bool, origin: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{origin}: {message}")


def canonical_schema(schema: dict[str, Any] | str, origin: str) -> str:
    """The schema as canonical JSON text, after refusing what the backend would not enforce."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{origin}: the schema is not valid JSON ({e})") from None
    _require(isinstance(schema, (dict, bool)), origin, "the schema must be a JSON object")
    checked = _check_schema(schema, origin, "#")
    return json.dumps(checked, separators=(",", ":"), ensure_ascii=False)


def _check_schema(node: Any, origin: str, path: str) -> Any:
    """``node`` with single-schema ``allOf``s inlined; raises on a keyword not enforced."""
    if isinstance(node, list):
        return [_check_schema(item, origin, f"{path}/{i}") for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    for key in node:
        if key in _UNENFORCED:
            raise ValueError(f"{origin}: the JSON schema keyword {key!r} ({_UNENFORCED[key]}, "
                             f"at {path}) is not supported")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"{origin}: $ref {ref!r} (at {path}) points outside the schema; only "
                         f"references within it ('#/...') are supported")
    node = _inline_all_of(node, origin, path)
    return {key: value if key in _DATA_KEYWORDS else _check_schema(value, origin, f"{path}/{key}")
            for key, value in node.items()}


def _inline_all_of(node: dict[str, Any], origin: str, path: str) -> dict[str, Any]:
    """``{"allOf": [S], <annotations>}`` (how pydantic wraps a reference) is S."""
    parts = node.get("allOf")
    if parts is None:
        return node
    others = set(node) - {"allOf"} - _ANNOTATIONS
    if isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict) and not others:
        return {**{k: v for k, v in node.items() if k != "allOf"}, **parts[0]}
    raise ValueError(f"{origin}: the JSON schema keyword 'allOf' (at {path}) is supported only "
                     f"as a single schema without siblings; merge the schemas")


def choice_grammar(choices: tuple[str, ...], origin: str) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    _require(isinstance(choices, tuple) and len(choices) > 0
             and all(isinstance(c, str) and c for c in choices), origin,
             "choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": ...}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @classmethod
    def parse(cls, value: Any, origin: str = "response_format") -> "ResponseFormat":
        """From a dict or its JSON text; ValueError naming ``origin`` and the bad field."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{origin}: not valid JSON ({e.msg})") from None
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in (origin, *first["loc"]))
            raise ValueError(f"{where}: {first['msg']}") from None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, origin="response_format")
        if self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        schema = self.json_schema.json_schema
        origin = "response_format.json_schema.schema"
        if schema is None:  # OpenAI allows a format without a schema: any JSON object
            return StructuredOutputsParams(json_object=True, origin=origin)
        return StructuredOutputsParams(json=schema, strict=bool(self.json_schema.strict),
                                       origin=origin)

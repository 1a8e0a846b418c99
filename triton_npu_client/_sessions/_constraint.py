"""What a chat reply must be: :class:`ResponseFormat`, sent as the chat model's ``CONSTRAINT`` input.

The server compiles it (llguidance) before the turn runs and masks, at every token, each id the reply may not take;
the turn ends when the format is complete. So a reply is always valid for its format unless it was cut short
(``finish_reason`` ``"length"`` or ``"context"``). This module only builds and checks the value; what is valid JSON
schema or regex syntax is the server's to say (an invalid one is refused before any token, as an
:class:`~triton_npu_client.InvalidArgumentError` naming ``CONSTRAINT``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

from .._errors import ChatOptionError

__all__ = ["ResponseFormat", "as_response_format"]

Kind = Literal["json_schema", "json_object", "regex", "grammar"]
_KINDS: Final = ("json_schema", "json_object", "regex", "grammar")


def _check_kind(_: object, __: object, value: Any) -> None:
    if value not in _KINDS:
        raise ChatOptionError("response_format", f"a kind among {', '.join(_KINDS)}", value)


@attrs.frozen(kw_only=True)
class ResponseFormat:
    """A reply's format: a JSON schema, any JSON object, a regex (the whole reply matches it) or a grammar.

    Build one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex` or :meth:`grammar`, or from OpenAI's
    ``response_format`` shape with :func:`as_response_format`. ``strict`` (JSON schema): a schema keyword the server
    cannot enforce is an error instead of being ignored. ``name`` is the schema's name (OpenAI's), for the caller.
    """

    kind: Kind = attrs.field(validator=_check_kind)
    schema: Any = None
    pattern: str | None = None
    grammar_text: str | None = None
    syntax: Literal["lark", "gbnf"] = "lark"
    strict: bool = True
    name: str | None = None

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | bool, *, strict: bool = True, name: str | None = None
    ) -> ResponseFormat:
        """Replies that are JSON valid for ``schema`` (a JSON schema as a mapping)."""
        if not isinstance(schema, Mapping | bool):
            raise ChatOptionError("response_format", "a JSON schema (a mapping)", schema)
        try:
            plain = json.loads(json.dumps(schema))  # a JSON-able copy: the value stays frozen in spirit
        except (TypeError, ValueError, RecursionError) as err:
            kind = type(schema).__name__
            raise ChatOptionError("response_format", f"a JSON-serialisable schema ({err})", kind) from None
        return cls(kind="json_schema", schema=plain, strict=bool(strict), name=name)

    @classmethod
    def json_object(cls) -> ResponseFormat:
        """Replies that are a JSON object (any)."""
        return cls(kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> ResponseFormat:
        """Replies that match ``pattern`` whole."""
        if not isinstance(pattern, str) or not pattern:
            raise ChatOptionError("response_format", "a non-empty regex string", pattern)
        return cls(kind="regex", pattern=pattern)

    @classmethod
    def grammar(cls, text: str, *, syntax: Literal["lark", "gbnf"] = "lark") -> ResponseFormat:
        """Replies that are sentences of the grammar ``text``: Lark (llguidance's dialect, which may embed a JSON
        schema with ``%json {...}``) or GBNF (llama.cpp's)."""
        if not isinstance(text, str) or not text.strip():
            raise ChatOptionError("response_format", "a non-empty grammar string", text)
        if syntax not in ("lark", "gbnf"):
            raise ChatOptionError("response_format", "a grammar syntax, lark or gbnf", syntax)
        return cls(kind="grammar", grammar_text=text, syntax=syntax)

    def wire(self) -> str:
        """The ``CONSTRAINT`` input's text (one JSON object)."""
        if self.kind == "json_schema":
            body: dict[str, Any] = {"type": "json_schema", "schema": self.schema, "strict": self.strict}
        elif self.kind == "json_object":
            body = {"type": "json_object"}
        elif self.kind == "regex":
            body = {"type": "regex", "pattern": self.pattern}
        else:
            body = {"type": "grammar", "syntax": self.syntax, "grammar": self.grammar_text}
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def as_response_format(value: ResponseFormat | Mapping[str, Any] | None) -> ResponseFormat | None:
    """``value`` as a :class:`ResponseFormat`: one already, or OpenAI's ``response_format`` mapping
    (``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, ``{"type": "json_object"}``,
    ``{"type": "text"}``: None, no format), or this SDK's own ``{"type": "regex", "pattern"}`` /
    ``{"type": "grammar", "grammar", "syntax"}``. :class:`ChatOptionError` otherwise."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, Mapping):
        raise ChatOptionError("response_format", "a ResponseFormat or an OpenAI response_format mapping", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat.json_object()
    if kind == "json_schema":
        nested = value.get("json_schema")
        holder: Mapping[str, Any] = nested if isinstance(nested, Mapping) else value
        if "schema" not in holder:
            raise ChatOptionError("response_format", "a json_schema with a 'schema'", dict(value))
        # OpenAI's default is not strict; every schema is enforced either way (strict only refuses what cannot be).
        strict = holder.get("strict") is True
        return ResponseFormat.json_schema(holder["schema"], strict=strict, name=holder.get("name"))
    if kind == "regex":
        return ResponseFormat.regex(value.get("pattern"))  # type: ignore[arg-type]
    if kind == "grammar":
        return ResponseFormat.grammar(value.get("grammar"), syntax=value.get("syntax", "lark"))  # type: ignore[arg-type]
    raise ChatOptionError(
        "response_format", "a type among text, json_object, json_schema, regex, grammar", kind
    )

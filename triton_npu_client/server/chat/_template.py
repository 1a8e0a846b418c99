"""A Hugging Face checkpoint's tokenizer and chat template, as the chat engine needs them.

:class:`CheckpointTokenizer` reads a checkpoint folder (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, ``config.json``, optionally ``chat_template.jinja``) and gives:

- :meth:`~CheckpointTokenizer.render`: a conversation through the checkpoint's own Jinja chat template, rendered as
  ``transformers``' ``apply_chat_template`` renders it (a sandboxed environment with ``trim_blocks``,
  ``lstrip_blocks`` and loop controls; ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape
  HTML; the tokenizer's named special tokens as variables), then tokenised. For ordinary text the ids are
  ``apply_chat_template(messages, tokenize=True)``'s.
- byte-exact streaming: :attr:`~CheckpointTokenizer.token_bytes` (each id's raw bytes) for byte-level BPE (GPT-2,
  Llama 3, Qwen2) and SentencePiece-style tokenizers (Llama 2, Mistral: ``▁`` for a space, ``<0x0A>`` byte-fallback
  pieces);
- :attr:`~CheckpointTokenizer.stop_ids`: the end-of-turn ids (``generation_config.json``'s ``eos_token_id``, one or a
  list, and the tokenizer's ``eos_token``).

**Text is text (a deliberate difference from transformers).** ``apply_chat_template`` tokenises the rendered string
whole, so a user who types ``<|eot_id|>`` in a message gets the end-of-turn token: the message forges the end of its
turn and whatever role comes next. Here only the control tokens the *template* writes become tokens: before
rendering, every control-token string inside a message's content is wrapped in two private markers (Unicode
noncharacters, which a message never needs and loses if it carries them); after rendering, the string is cut at the
unmarked control tokens (the template's own), and the text between them, marked tokens included, is encoded with
no control token matched. A content that holds no control-token string gives exactly transformers' ids.

**Tools.** ``render(..., tools=[...])`` passes OpenAI-style tool definitions to the template as ``apply_chat_template``
does (and picks the checkpoint's ``tool_use`` template when it has one, as transformers does); messages may be
:class:`ChatMessage` values carrying an assistant's ``tool_calls`` or a ``tool`` result. Every string the caller gives
is marked, as contents are: tool results, tool-call names and arguments (keys and values), tool names, descriptions
and schemas, and the template variables. :attr:`~CheckpointTokenizer.takes_tools` says whether the template reads
``tools`` at all, :attr:`~CheckpointTokenizer.tool_format` which tool-call format its replies use (``_tools``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ._tools import ToolCall, ToolFormat, check_tools, detect_tool_format

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Tokenizer

__all__ = ["ChatMessage", "ChatTemplateError", "CheckpointTokenizer", "ToolCall"]

# Unicode noncharacters: reserved for a program's internal use, so no message needs them.
_MARK_START: Final = "\ufdd0"
_MARK_END: Final = "\ufdd1"
_SPM_SPACE: Final = "\u2581"  # SentencePiece's "▁"
_BYTE_PIECE: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# json.dumps(..., ensure_ascii=True) spells the markers as escapes; an escape preceded by an even number of
# backslashes is one (an odd number: the text held a literal backslash-u sequence, which stays text).
_ESCAPED_MARK: Final = re.compile(r"(?<!\\)((?:\\\\)*)\\u(fdd0|fdd1)")


class ChatTemplateError(ValueError):
    """The checkpoint's chat template refused a conversation, or cannot be rendered."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation, with what tool use needs; what a template sees is :meth:`template_value`.

    - ``ChatMessage("user", "Hi")``; ``("user", "Hi")`` pairs are taken by :meth:`CheckpointTokenizer.render` too.
    - An assistant's calls: ``ChatMessage("assistant", tool_calls=(ToolCall(name, arguments_json, id),))``, with
      ``content`` the text before the calls, or None.
    - A result: ``ChatMessage("tool", "22 C", tool_call_id="abc123def", name="get_weather")``.

    ``content`` None, no ``tool_calls``, ``tool_call_id`` None and ``name`` None are left out of the message the
    template sees (templates test ``'tool_calls' in message`` or ``message.tool_calls is defined``), as
    transformers drops a message's None values.
    """

    role: str
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, str):
            raise ValueError(f"a message's role must be a string, got {type(self.role).__name__}")
        if self.content is not None and not isinstance(self.content, str):
            raise ValueError(f"a {self.role} message's content must be text, got {type(self.content).__name__}")
        if not isinstance(self.tool_calls, tuple) or not all(isinstance(c, ToolCall) for c in self.tool_calls):
            raise ValueError(f"a {self.role} message's tool_calls must be a tuple of ToolCall")
        for key in ("tool_call_id", "name"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"a {self.role} message's {key} must be a string, got {type(value).__name__}")

    def template_value(self) -> dict[str, Any]:
        """The message as a chat template is given it: ``tool_calls`` in OpenAI's shape with ``arguments`` decoded
        into an object (what transformers' docs pass and what the Llama 3, Qwen2.5 and Mistral templates write with
        ``tojson``; a JSON string there would be written as a quoted string), as vLLM decodes them before rendering."""
        out: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                value: dict[str, Any] = {
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_object()},
                }
                calls.append(value if call.id is None else {"id": call.id, **value})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_openai(cls, message: Mapping[str, Any]) -> ChatMessage:
        """From an OpenAI chat message (``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``name``); content
        given as a list of ``{"type": "text", "text"}`` parts is joined. ``ValueError`` for anything else."""
        if not isinstance(message, Mapping):
            raise ValueError(f"a message must be an object, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ValueError("a message's content parts must all be {'type': 'text', 'text': ...}")
            content = "".join(str(t) for t in texts)
        calls = message.get("tool_calls") or ()
        if not isinstance(calls, (list, tuple)):
            raise ValueError(f"a message's tool_calls must be a list, got {type(calls).__name__}")
        return cls(
            role=message.get("role"),  # type: ignore[arg-type]  # checked in __post_init__
            content=content,
            tool_calls=tuple(ToolCall.from_openai(c) for c in calls),
            tool_call_id=message.get("tool_call_id"),
            name=message.get("name"),
        )


Message = tuple[str, str] | ChatMessage


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for every byte value, inverted: character -> byte.

    Byte-level tokenizers (GPT-2's scheme) spell each byte as a visible character: the printable Latin-1 bytes as
    themselves, the other 68 (controls, space, soft hyphen...) as U+0100 onwards, in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in visible}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: object) -> list[int]:
    """``eos_token_id`` as the configs write it: one id, a list of ids, or nothing."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _components(node: object) -> Iterable[dict[str, Any]]:
    """A tokenizer.json pipeline component and, for a ``Sequence``, the components inside it, in order."""
    if not isinstance(node, dict):
        return
    yield node
    for key in ("pretokenizers", "decoders", "normalizers"):
        for child in node.get(key) or ():
            yield from _components(child)


def _chat_templates(folder: Path, config: dict[str, Any]) -> tuple[dict[str, tuple[str, str]], str] | None:
    """The checkpoint's chat templates by name (``default``, ``tool_use``...), each with the file it came from, as
    transformers reads them; and where to say the templates are; None when there is none.

    Template files (``chat_template.jinja``: the default; ``additional_chat_templates/NAME.jinja``) override
    tokenizer_config.json's ``chat_template`` (one string, or a list of ``{name, template}``), as in transformers.
    """
    jinja_file = folder / "chat_template.jinja"
    extra = sorted((folder / "additional_chat_templates").glob("*.jinja"))
    if jinja_file.is_file() or extra:
        files = {p.name.removesuffix(".jinja"): p for p in extra}
        if jinja_file.is_file():
            files["default"] = jinja_file
        return {name: (p.read_text(encoding="utf-8"), str(p)) for name, p in files.items()}, str(folder)
    where = str(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return {"default": (template, where)}, where
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return {str(k): (v, where) for k, v in named.items() if isinstance(v, str)}, where
    raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}}, got {template!r:.80}")


class _Refusal(Exception):
    """``raise_exception(message)`` in a template: the template refuses the conversation it was given."""


def _environment() -> Any:
    """A sandbox like transformers': immutable objects, trim_blocks/lstrip_blocks, loop controls, its helpers."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < (3, 1, 6):
        # Chat templates come with downloaded checkpoints: untrusted code, and older sandboxes have known escapes.
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (sandbox escapes fixed), found {jinja2.__version__}")

    def raise_exception(message: object) -> None:
        raise _Refusal(str(message))

    def tojson(
        value: object,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt a model was trained on.
        out = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        if ensure_ascii and "\\ufdd" in out:
            # The markers around a control token in a string would come out as escapes, and the token unmarked:
            # put the markers back, so the token stays text (transformers' sanitizer has the same hole; its ids
            # for such a string are not ours).
            out = _ESCAPED_MARK.sub(lambda m: m.group(1) + chr(int(m.group(2), 16)), out)
        return out

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")

    class Namespace(jinja2.utils.Namespace):
        # One that stores no underscore names, so a template cannot reach Python internals through it.
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            super().__init__(attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    return env


@dataclass(frozen=True, slots=True)
class _Control:
    """A control token: an added token that a message's text must never become."""

    content: str
    id: int
    lstrip: bool
    rstrip: bool


class CheckpointTokenizer:
    """A checkpoint folder's tokenizer and chat template; see the module docstring.

    Attributes: ``vocab_size`` (the tokenizer's ids: ``token_bytes`` has that many entries), ``token_bytes``
    (each id's raw bytes, ``b""`` for a special token), ``stop_ids`` (the ids that end a reply), ``bos_id``
    (``tokenizer_config.json``'s ``bos_token``, or None), ``eos_id`` (its ``eos_token``, or None), ``special_ids``
    (the ids of the special tokens), ``added_tokens`` (every added token's text -> id), ``chat_template`` (the
    default template's Jinja source) and ``chat_template_path``, ``tool_template`` (the ``tool_use`` template, used
    when tools are given, or None) and ``tool_template_path``, ``model_type`` (config.json's, or None).
    Tools: :attr:`takes_tools`, :attr:`tool_format`, :attr:`tools_refusal`, :attr:`tool_marker_ids`.
    Thread-safe once built: ``render``, ``encode`` and ``decode`` may run on several threads at once.
    """

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.folder = folder
        tokenizer_file = folder / "tokenizer.json"
        raw = _read_json(tokenizer_file)
        if raw is None:
            raise ValueError(f"{folder}: no tokenizer.json (a Hugging Face fast tokenizer) in the checkpoint folder")
        config = _read_json(folder / "tokenizer_config.json") or {}
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json") or {}

        found = _chat_templates(folder, config)
        if found is None:
            raise ValueError(
                f"{folder / 'tokenizer_config.json'}: the checkpoint has no chat_template (nor chat_template.jinja), "
                "so there is no way to know how it expects a conversation; add the template it was trained with"
            )
        templates, where = found
        if "default" not in templates:
            raise ValueError(f"{where}: chat templates {sorted(templates)} are given but none named 'default'")
        self.chat_template, self.chat_template_path = templates["default"]
        self.tool_template: str | None = None
        self.tool_template_path: str | None = None
        if "tool_use" in templates:  # what transformers renders a conversation with tools with
            self.tool_template, self.tool_template_path = templates["tool_use"]
        model_type = model_config.get("model_type")
        self.model_type: str | None = model_type if isinstance(model_type, str) else None
        self._env = _environment()
        self._template: Template = self._compile(self.chat_template, self.chat_template_path)
        self._tool_template: Template | None = None
        if self.tool_template is not None and self.tool_template_path is not None:
            self._tool_template = self._compile(self.tool_template, self.tool_template_path)

        full = Tokenizer.from_str(json.dumps(raw))
        vocab: dict[str, int] = full.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        added = [t for t in raw.get("added_tokens") or () if isinstance(t, dict) and isinstance(t.get("content"), str)]
        special = {str(t["content"]) for t in added if t.get("special")}
        self.special_ids = frozenset(int(t["id"]) for t in added if t.get("special"))
        self.added_tokens: dict[str, int] = {str(t["content"]): int(t["id"]) for t in added}

        # The named special tokens a template sees as variables (bos_token, eos_token...), as transformers passes them.
        self._variables: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            text = _token_text(config.get(name))
            if text is not None:
                self._variables[name] = text
        bos, eos_token = self._variables.get("bos_token"), self._variables.get("eos_token")
        self.bos_id: int | None = None if bos is None else vocab.get(bos)
        self.eos_id: int | None = None if eos_token is None else vocab.get(eos_token)
        eos = _ids((generation if generation is not None else model_config).get("eos_token_id"))
        self.stop_ids = frozenset([*eos, *([] if self.eos_id is None else [self.eos_id])])

        # Control tokens, as transformers' sanitize_control_tokens chooses them: every special token, plus the other
        # added tokens the template writes in its own text (not whitespace ones such as "\n\n", which are text), or
        # those tokenizer_config.json lists as chat_control_tokens.
        listed = config.get("chat_control_tokens")
        literal = self._literal_text()
        controls: list[_Control] = []
        for t in added:
            content = str(t["content"])
            if isinstance(listed, list):
                chosen = content in special or content in listed
            else:
                chosen = content in special or (content in literal and not content.isspace())
            if chosen:
                controls.append(_Control(content, int(t["id"]), bool(t.get("lstrip")), bool(t.get("rstrip"))))
        self._controls = {c.content: c for c in controls}
        self.control_ids = frozenset(c.id for c in controls)
        alternatives = "|".join(re.escape(c) for c in sorted(self._controls, key=len, reverse=True)) or "(?!)"
        self._control_re = re.compile(alternatives)
        # In a rendered conversation: a marked control token (text), a lone marker (a template's string method cut
        # a marked token: dropped), or a control token the template wrote.
        marks = f"{_MARK_START}{_MARK_END}"
        self._pieces_re = re.compile(f"{_MARK_START}({alternatives}){_MARK_END}|[{marks}]|({alternatives})")

        # Text encoders: the same pipeline with every control token marked special and special tokens not matched,
        # so text never becomes one. SentencePiece's "prepend a ▁ to the first piece" (Metaspace, scheme "first")
        # applies only to text at the very start of the rendered string, as when transformers encodes it whole.
        text_raw = json.loads(json.dumps(raw))
        for t in text_raw.get("added_tokens") or ():
            if isinstance(t, dict) and t.get("content") in self._controls:
                t["special"] = True
        self._text_first = self._text_encoder(text_raw)
        first_only = False
        for component in _components(text_raw.get("pre_tokenizer")):
            if component.get("type") == "Metaspace" and component.get("prepend_scheme") == "first":
                component["prepend_scheme"] = "never"
                first_only = True
        self._text = self._text_encoder(text_raw) if first_only else self._text_first

        self.token_bytes, self._first_bytes, self._strip_spaces = self._byte_table(raw, vocab, special)
        self._setup_tools()

    @staticmethod
    def _text_encoder(raw: dict[str, Any]) -> Tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(json.dumps(raw))
        tok.encode_special_tokens = True
        tok.no_truncation()
        tok.no_padding()
        return tok

    def _compile(self, source: str, where: str) -> Template:
        import jinja2

        try:
            template: Template = self._env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{where}: the chat template does not parse: {e}") from None
        return template

    def _literal_text(self) -> str:
        """The templates' literal strings (their text and string constants), NUL-joined so none match across two.

        Both templates' (the default and ``tool_use``), so that a message's text is text whichever renders it.
        """
        from jinja2 import nodes

        literals: set[str] = set()
        for source in (self.chat_template, self.tool_template):
            if source is None:
                continue
            tree = self._env.parse(source)
            literals |= {n.data for n in tree.find_all(nodes.TemplateData)}
            literals |= {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
        return "\0".join(sorted(literals))

    def _byte_table(
        self, raw: dict[str, Any], vocab: dict[str, int], special: set[str]
    ) -> tuple[list[bytes], dict[int, bytes], int]:
        """Each id's bytes; the bytes of ids that read differently as a reply's first token; leading spaces the
        decoder strips from a whole reply."""
        model = raw.get("model") or {}
        decoder = list(_components(raw.get("decoder")))
        pipeline = [*decoder, *_components(raw.get("pre_tokenizer")), *_components(raw.get("normalizer"))]
        kinds = {c.get("type") for c in pipeline}
        added = {str(t["content"]) for t in raw.get("added_tokens") or () if isinstance(t, dict) and "content" in t}
        table: list[bytes] = [b""] * self.vocab_size
        first: dict[int, bytes] = {}
        strip = 0
        if "ByteLevel" in kinds:
            alphabet = _byte_alphabet()

            def spell(token: str) -> bytes:
                return bytes(alphabet[c] for c in token)
        elif {"Metaspace", "Replace"} & kinds:
            space = next(
                (str(c.get("replacement")) for c in pipeline if c.get("type") == "Metaspace" and c.get("replacement")),
                _SPM_SPACE,
            )
            byte_fallback = bool(model.get("byte_fallback"))

            def spell(token: str) -> bytes:
                if byte_fallback and (m := _BYTE_PIECE.fullmatch(token)):
                    return bytes([int(m.group(1), 16)])
                return token.replace(space, " ").encode("utf-8")

            for c in decoder:
                # The Metaspace decoder drops every ▁ of the first token of what it decodes (the space the encoder
                # prepended); a Strip decoder after Fuse strips leading spaces of the whole text.
                scheme = c.get("prepend_scheme") or ("always" if c.get("add_prefix_space", True) else "never")
                if c.get("type") == "Metaspace" and scheme != "never":
                    for token, index in vocab.items():
                        if space in token and token not in added:
                            first[index] = token.replace(space, "").encode("utf-8")
                if c.get("type") == "Strip" and c.get("content") == " ":
                    strip = int(c.get("start") or 0)
        else:
            raise ValueError(
                f"{self.folder / 'tokenizer.json'}: neither byte-level BPE nor SentencePiece-style "
                f"(its pipeline has {sorted(map(str, kinds - {None}))}); a reply could not be streamed as bytes"
            )
        for token, index in vocab.items():
            if token in special:
                continue
            if token in added:  # a non-special added token is stored as plain text
                table[index] = token.encode("utf-8")
                continue
            try:
                table[index] = spell(token)
            except KeyError:
                raise ValueError(f"{self.folder / 'tokenizer.json'}: token {token!r} is not byte-level BPE") from None
        return table, first, strip

    # -- the API --------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Plain text's ids as they are inside a conversation (after a template token): no control token matched,
        no SentencePiece prefix ▁ added (a legacy ``Prepend`` normalizer still adds its own, as it does there)."""
        return list(self._text.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> bytes:
        """A reply's bytes: ``token_bytes`` joined, with the leading space that the tokenizer's decoder drops from
        the first token (SentencePiece's prepended ▁) dropped, as ``transformers``' ``decode(ids,
        skip_special_tokens=True)`` does. Special tokens give no bytes."""
        table = self.token_bytes
        kept = [i for i in ids if i not in self.special_ids]
        if not kept:
            return b""
        out = self._first_bytes.get(kept[0], table[kept[0]]) + b"".join(table[i] for i in kept[1:])
        for _ in range(self._strip_spaces):
            if not out.startswith(b" "):
                break
            out = out[1:]
        return out

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids of a conversation (oldest first) in the checkpoint's chat template.

        ``messages``: ``(role, content)`` pairs or :class:`ChatMessage` values (assistant tool calls, tool results),
        mixed as needed. ``tools``: OpenAI-style tool definitions (``{"type": "function", "function": {"name",
        "description", "parameters"}}``), checked by ``_tools.check_tools``; None is "no tools" (an empty list is
        passed on as one, as transformers does, and some templates then still announce tools). With tools the
        checkpoint's ``tool_use`` template is used when it has one. ``variables``: more template variables
        (``date_string`` for Llama 3; they override the special-token variables, as ``apply_chat_template``'s
        keyword arguments do).

        Equal to ``transformers``' ``apply_chat_template(..., tools=tools, tokenize=True, **variables)`` when no
        string the caller gives holds a control token's text; such a string never becomes a control token (see the
        module docstring). :class:`ChatTemplateError` (a ``ValueError``) when the template refuses the conversation;
        ``ValueError`` for malformed tools.
        """
        rendered = self._render_marked(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, variables=variables
        )
        return self._tokenize(rendered)

    def encode_controls(self, text: str) -> list[int]:
        """Text written by the server itself (a forced call's prefix such as ``[TOOL_CALLS]`` or ``<tool_call>\\n``)
        as ids inside a conversation: its control-token strings become the tokens, the rest is text."""
        return self._tokenize(text, at_start=False)

    def split_controls(self, text: str) -> list[str | int]:
        """Text written by the server itself cut at its control-token strings: the text between them, and each
        control token's id (what a grammar must write as that one token: ``_tools.forced_grammar``)."""
        out: list[str | int] = []
        at = 0
        for m in self._control_re.finditer(text):
            if m.start() > at:
                out.append(text[at : m.start()])
            out.append(self._controls[m.group(0)].id)
            at = m.end()
        if at < len(text):
            out.append(text[at:])
        return out

    @property
    def takes_tools(self) -> bool:
        """Whether the template used with tools reads the ``tools`` variable at all; a template that does not would
        drop a request's tools silently, so tools are to be refused for it (:attr:`tools_refusal`)."""
        return self._takes_tools

    @property
    def tool_format(self) -> ToolFormat | None:
        """The tool-call format the checkpoint's replies use (``_tools.detect_tool_format``: by the template used with
        tools, the added tokens, then ``model_type``); None when unknown or when the template takes no tools."""
        return self._tool_format

    @property
    def tools_refusal(self) -> str | None:
        """Why a request with tools cannot be served on this checkpoint, as a message; None when it can."""
        return self._tools_refusal

    @property
    def tool_marker_ids(self) -> dict[int, str]:
        """The special tokens among :attr:`tool_format`'s markup (``[TOOL_CALLS]``, ``<|python_tag|>``; ``<tool_call>``
        and ``</tool_call>`` where a Hermes vocabulary makes them special), id -> text.

        Their :attr:`token_bytes` are empty, as for every special token, but a tool-call parser must see them (vLLM
        turns ``skip_special_tokens`` off for these parsers for the same reason): the text a parser is fed is the
        reply's bytes with these ids' text put in; what the client is shown is what the parser returns as content.
        """
        return dict(self._tool_marker_ids)

    def _setup_tools(self) -> None:
        import jinja2.meta

        source = self.tool_template if self.tool_template is not None else self.chat_template
        where = self.tool_template_path if self.tool_template_path is not None else self.chat_template_path
        self._takes_tools = "tools" in jinja2.meta.find_undeclared_variables(self._env.parse(source))
        self._tool_format: ToolFormat | None = None
        self._tool_marker_ids: dict[int, str] = {}
        self._tools_refusal: str | None = None
        if not self._takes_tools:
            self._tools_refusal = (
                f"this checkpoint's chat template ({where}) does not read tools, so the model would never see them; "
                "tools need a checkpoint whose template renders them"
            )
            return
        self._tool_format = detect_tool_format(source, self.added_tokens, self.model_type)
        if self._tool_format is None:
            self._tools_refusal = (
                f"this checkpoint's chat template ({where}) takes tools, but neither it, its tokenizer nor its "
                f"model_type ({self.model_type}) shows a tool-call format this server can read "
                "(Llama 3 JSON, Hermes/Qwen2.5 <tool_call>, Mistral [TOOL_CALLS])"
            )
            return
        for marker in self._tool_format.markup:
            index = self.added_tokens.get(marker)
            if index is not None and index in self.special_ids:
                self._tool_marker_ids[index] = marker

    def _render_marked(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered template, every caller's string marked (what :meth:`_tokenize` cuts)."""
        import jinja2

        chat: list[dict[str, Any]] = []
        for message in messages:
            if isinstance(message, ChatMessage):
                chat.append(message.template_value())
            else:
                role, content = message
                chat.append({"role": role, "content": content})
        marked_tools = None if tools is None else self._mark_value(check_tools(tools))
        template = self._template
        where = self.chat_template_path
        if tools is not None and self._tool_template is not None:
            template, where = self._tool_template, str(self.tool_template_path)
        extra = {} if variables is None else self._mark_value(dict(variables))
        try:
            return str(
                template.render(
                    messages=self._mark_value(chat),
                    tools=marked_tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **{**self._variables, **extra},
                )
            )
        except _Refusal as e:
            raise ChatTemplateError(f"the checkpoint's chat template ({where}) refused the conversation: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise ChatTemplateError(
                f"the checkpoint's chat template ({where}) failed: {type(e).__name__}: {e}"
            ) from None

    def _mark_value(self, value: Any) -> Any:
        """Every string inside ``value`` (lists, tuples, dicts: keys and values) marked; other values as they are.

        Keys too, unlike transformers' ``mark_control_tokens``: templates write them (a tool's parameter names, an
        argument's keys), and a key is as much the caller's text as a value.
        """
        if isinstance(value, str):
            return self._mark(value)
        if isinstance(value, dict):
            return {self._mark_value(k): self._mark_value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark_value(v) for v in value]
        return value

    def _mark(self, text: str) -> str:
        text = text.replace(_MARK_START, "").replace(_MARK_END, "")
        return self._control_re.sub(lambda m: f"{_MARK_START}{m.group(0)}{_MARK_END}", text)

    def _tokenize(self, rendered: str, *, at_start: bool = True) -> list[int]:
        """Cut a rendered conversation at the template's control tokens and encode the text between them
        (``at_start``: the text is the start of the whole string, where SentencePiece prepends its ▁)."""
        out: list[int] = []
        run: list[str] = []  # text since the last control token (marked tokens as text, lone markers dropped)
        run_at = 0 if at_start else -1  # where that text starts in `rendered` (-1: not at the start of anything)
        position = 0
        rstrip = False  # the last control token takes the whitespace after it (an added token's rstrip)
        for m in self._pieces_re.finditer(rendered):
            between = rendered[position : m.start()]
            position = m.end()
            if rstrip:
                between = between.lstrip()
                rstrip = False
            run.append(between)
            if m.group(2) is None:
                run.append(m.group(1) or "")
                continue
            control = self._controls[m.group(2)]
            text = "".join(run)
            self._encode_run(text.rstrip() if control.lstrip else text, run_at, out)
            out.append(control.id)
            run.clear()
            run_at = position
            rstrip = control.rstrip
        tail = rendered[position:]
        run.append(tail.lstrip() if rstrip else tail)
        self._encode_run("".join(run), run_at, out)
        return out

    def _encode_run(self, text: str, at: int, out: list[int]) -> None:
        if not text:
            return
        # SentencePiece prepends its ▁ only to text at the very start of the whole string (Metaspace "first").
        encoder = self._text_first if at == 0 else self._text
        ids = encoder.encode(text, add_special_tokens=False).ids
        forged = self.control_ids.intersection(ids)
        if forged:  # a tokenizer whose model spells a control token from plain characters (some Unigram vocabularies)
            raise ChatTemplateError(
                f"the tokenizer makes control token id(s) {sorted(forged)} out of the plain text {text[:80]!r}"
            )
        out.extend(ids)

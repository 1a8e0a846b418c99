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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Tokenizer

__all__ = ["ChatTemplateError", "CheckpointTokenizer"]

# Unicode noncharacters: reserved for a program's internal use, so no message needs them.
_MARK_START: Final = "\ufdd0"
_MARK_END: Final = "\ufdd1"
_SPM_SPACE: Final = "\u2581"  # SentencePiece's "▁"
_BYTE_PIECE: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ChatTemplateError(ValueError):
    """The checkpoint's chat template refused a conversation, or cannot be rendered."""


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


def _chat_template(folder: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """The default chat template and where it came from, as transformers picks it; None when there is none."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():  # transformers lets this file override tokenizer_config.json's entry
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    where = str(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return template, where
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen, where
        raise ValueError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
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
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

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
    (the ids of the special tokens), ``chat_template`` (the Jinja source) and ``chat_template_path``.
    Thread-safe once built: ``render``, ``encode`` and ``decode`` may run on several threads at once.
    """

    def __init__(self, folder: str | Path) -> None:
        import jinja2
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

        found = _chat_template(folder, config)
        if found is None:
            raise ValueError(
                f"{folder / 'tokenizer_config.json'}: the checkpoint has no chat_template (nor chat_template.jinja), "
                "so there is no way to know how it expects a conversation; add the template it was trained with"
            )
        self.chat_template, self.chat_template_path = found
        self._env = _environment()
        try:
            self._template: Template = self._env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.chat_template_path}: the chat template does not parse: {e}") from None

        full = Tokenizer.from_str(json.dumps(raw))
        vocab: dict[str, int] = full.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        added = [t for t in raw.get("added_tokens") or () if isinstance(t, dict) and isinstance(t.get("content"), str)]
        special = {str(t["content"]) for t in added if t.get("special")}
        self.special_ids = frozenset(int(t["id"]) for t in added if t.get("special"))

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

    @staticmethod
    def _text_encoder(raw: dict[str, Any]) -> Tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(json.dumps(raw))
        tok.encode_special_tokens = True
        tok.no_truncation()
        tok.no_padding()
        return tok

    def _literal_text(self) -> str:
        """The template's literal strings (its text and string constants), NUL-joined so none match across two."""
        from jinja2 import nodes

        tree = self._env.parse(self.chat_template)
        literals = {n.data for n in tree.find_all(nodes.TemplateData)}
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

    def render(self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool) -> list[int]:
        """The ids of a conversation (``(role, content)`` pairs, oldest first) in the checkpoint's chat template.

        Equal to ``transformers``' ``apply_chat_template(..., tokenize=True)`` when no content holds a control
        token's text; a content's text never becomes a control token (see the module docstring).
        :class:`ChatTemplateError` (a ``ValueError``) when the template refuses the conversation.
        """
        return self._tokenize(self._render_marked(messages, add_generation_prompt=add_generation_prompt))

    def _render_marked(self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool) -> str:
        """The rendered template, the control-token strings of the contents marked (what :meth:`_tokenize` cuts)."""
        import jinja2

        marked = [{"role": self._mark(role), "content": self._mark(content)} for role, content in messages]
        try:
            return str(
                self._template.render(
                    messages=marked,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self._variables,
                )
            )
        except _Refusal as e:
            where = self.chat_template_path
            raise ChatTemplateError(f"the checkpoint's chat template ({where}) refused the conversation: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise ChatTemplateError(
                f"the checkpoint's chat template ({self.chat_template_path}) failed: {type(e).__name__}: {e}"
            ) from None

    def _mark(self, text: str) -> str:
        text = text.replace(_MARK_START, "").replace(_MARK_END, "")
        return self._control_re.sub(lambda m: f"{_MARK_START}{m.group(0)}{_MARK_END}", text)

    def _tokenize(self, rendered: str) -> list[int]:
        """Cut a rendered conversation at the template's control tokens and encode the text between them."""
        out: list[int] = []
        run: list[str] = []  # text since the last control token (marked tokens as text, lone markers dropped)
        run_at = 0  # where that text starts in `rendered`
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

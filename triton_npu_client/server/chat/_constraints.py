"""Constrained decoding: a turn's constraint compiled once by llguidance, applied as a token mask per row.

A turn may carry a constraint (the ``CONSTRAINT`` input, one JSON object):

- ``{"type": "json_schema", "schema": {...}, "strict": true}`` (OpenAI's ``response_format`` shape, with the schema
  nested in ``"json_schema": {"name", "schema", "strict"}``, is taken too): the reply is JSON valid for the schema;
- ``{"type": "json_object"}``: the reply is a JSON object;
- ``{"type": "regex", "pattern": "..."}``: the reply matches the regex, whole;
- ``{"type": "grammar", "syntax": "lark" | "gbnf", "grammar": "..."}``: the reply is a sentence of the grammar
  (llguidance's Lark dialect, which can embed a JSON schema with ``%json {...}``; GBNF as llama.cpp writes it).

**Why llguidance.** It is what vLLM, SGLang and llama.cpp can use for this (beside xgrammar), its wheel depends on
nothing (xgrammar's pulls transformers, triton and more into the stub's environment), it compiles a JSON schema in
moments and computes a mask in microseconds: ``bench/chat.py``'s constrained table measures what it costs a pass
at 32 conversations. Its matcher advances by token, can roll back, and says when the grammar is complete.

**Where the work happens.** :meth:`Constraints.matcher` runs in ``parse`` on an execute thread: the constraint is
parsed, checked against the size cap and compiled there (a compile error is the request's invalid input, before any
token), and each distinct constraint is compiled once (an LRU of ``capacity`` compiled matchers; a turn takes a
copy). On the loop's thread a pass only fills the masks of its constrained rows (:func:`fill_masks`, into one int32
array of ``words`` per row, a bit per id) and the sampler applies them on the device in one batched operation; a
batch without a constrained row does none of it.

**One matcher per turn.** The matcher advances with every token the turn takes (:meth:`TurnMatcher.consume`) and is
dropped with the turn: a cancelled, superseded or failed turn leaves nothing behind, so the conversation's next turn
starts its own matcher as if the other never ran. A step that raises and runs again rolls back what it consumed.

llguidance is imported lazily: a server without it serves every unconstrained turn, and refuses a constrained one by
name.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    import numpy as np

    from ._template import CheckpointTokenizer

__all__ = ["ConstraintSpec", "Constraints", "TurnMatcher", "fill_masks", "parse_constraint"]

Kind = Literal["json_schema", "json_object", "regex", "grammar"]
KINDS: Final[tuple[str, ...]] = ("json_schema", "json_object", "regex", "grammar")
#: How a JSON reply is spaced: as Python's ``json.dumps`` writes it (what models most often saw), and no other way,
#: so a model cannot pad a reply with whitespace until it runs out of tokens.
_JSON_LAYOUT: Final[dict[str, Any]] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ERROR_CHARS: Final = 600  # a compile error is the user's own grammar's, but its echo is kept short


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """A parsed constraint: its kind and its source, canonical (spelled alike up to JSON spacing: equal keys)."""

    kind: Kind
    source: str  # the schema as canonical JSON, the regex, or the grammar's text
    strict: bool = True
    syntax: str = ""  # a grammar's: "lark" or "gbnf"

    @property
    def key(self) -> tuple[str, str, bool, str]:
        return (self.kind, self.source, self.strict, self.syntax)


def _refuse(message: str) -> ValueError:
    return ValueError(f"{_NAME}: {message}")


_NAME: Final = "CONSTRAINT"


def parse_constraint(raw: bytes | str) -> ConstraintSpec:
    """The constraint a ``CONSTRAINT`` input holds; ``ValueError`` naming what is wrong (see the module docstring)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else str(raw)
        value = json.loads(text)
    except (UnicodeDecodeError, ValueError) as err:
        raise _refuse(f"expected one JSON object, given text that is not JSON ({err})") from None
    except RecursionError:
        # Nesting deeper than Python's JSON reader goes (thousands of levels fit under max_constraint_bytes): this
        # request's error, never one that escapes parse (execute would fail the requests batched with it).
        raise _refuse("expected one JSON object, given JSON nested too deeply to read") from None
    if not isinstance(value, dict):
        raise _refuse(f"expected a JSON object with a 'type', given a JSON {type(value).__name__}")
    kind = value.get("type")
    if kind not in KINDS:
        raise _refuse(f"'type' must be one of {', '.join(KINDS)}, given {kind!r:.60}")
    if kind == "json_object":
        return ConstraintSpec("json_object", '{"type":"object"}')
    if kind == "json_schema":
        nested = value.get("json_schema")
        holder = nested if isinstance(nested, dict) else value
        schema = holder.get("schema")
        if not isinstance(schema, dict | bool):
            raise _refuse(f"a json_schema needs 'schema', a JSON schema object, given {type(schema).__name__}")
        strict = holder.get("strict", value.get("strict", True))
        if not isinstance(strict, bool) and strict is not None:
            raise _refuse(f"'strict' must be true or false, given {strict!r:.40}")
        # Not sorted: the compiler writes an object's properties in the schema's order (OpenAI's strict mode does
        # too, and a caller's model class lists its fields in the order it wants them).
        canonical = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return ConstraintSpec("json_schema", canonical, strict=strict is not False)
    if kind == "regex":
        pattern = value.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise _refuse("a regex needs 'pattern', a non-empty string")
        return ConstraintSpec("regex", pattern)
    syntax = value.get("syntax", "lark")
    grammar = value.get("grammar")
    if syntax not in ("lark", "gbnf"):
        raise _refuse(f"a grammar's 'syntax' must be lark or gbnf, given {syntax!r:.40}")
    if not isinstance(grammar, str) or not grammar.strip():
        raise _refuse("a grammar needs 'grammar', its non-empty text")
    return ConstraintSpec("grammar", grammar, syntax=syntax)


class TurnMatcher:
    """One turn's matcher: what the reply may take next, advanced by each token it takes.

    ``consumed`` counts the tokens taken, so that a step that raised can roll back exactly what it consumed.
    """

    __slots__ = ("_matcher", "consumed")

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.consumed = 0

    def consume(self, token: int) -> bool:
        """Take ``token``; False when the constraint does not allow it (the matcher is then in error)."""
        ok = bool(self._matcher.consume_token(token))
        if ok:
            self.consumed += 1
        return ok

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` taken."""
        if tokens > 0:
            self._matcher.rollback(tokens)
            self.consumed -= tokens

    @property
    def complete(self) -> bool:
        """The constraint allows nothing more: the reply is whole (and ends here, without an end token)."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """What the reply holds so far is a whole sentence (an end token is allowed here)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error()) if self._matcher.is_error() else ""

    def fill(self, row: np.ndarray[Any, Any]) -> None:
        """Write the mask of the ids allowed next into ``row`` (int32, contiguous, ``words`` long)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)


def fill_masks(matchers: Sequence[TurnMatcher | None], words: int) -> np.ndarray[Any, Any]:
    """The masks of a batch's rows, ``[rows, words]`` int32: a constrained row's allowed ids, every id for the rest."""
    import numpy as np

    masks = np.full((len(matchers), words), -1, dtype=np.int32)
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill(masks[row])
    return masks


class Constraints:
    """Compiles constraints for one tokenizer, each distinct one once (an LRU of ``capacity``); thread-safe.

    ``stop_ids`` are the ids that end a reply: the matcher allows them where the reply is whole.
    """

    def __init__(self, tokenizer: CheckpointTokenizer, *, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.vocab = tokenizer.vocab_size
        self.words = -(-self.vocab // 32)
        self._tokenizer_json = (tokenizer.folder / "tokenizer.json").read_text(encoding="utf-8")
        self._stop_ids = sorted(tokenizer.stop_ids)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str, bool, str], Any] = OrderedDict()
        self._ll_tokenizer: Any = None
        self.compiles = 0  # for tests: how many constraints were compiled (not found in the cache)

    @staticmethod
    def available() -> bool:
        """Whether llguidance can be imported here."""
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return True

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            try:
                import llguidance
            except ImportError:
                raise _refuse(
                    "this server cannot constrain replies: the llguidance package is not installed in the model's "
                    "Python environment (pip install llguidance)"
                ) from None
            # The checkpoint's own tokenizer.json, so the matcher knows each id's bytes exactly as the engine does.
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab, eos_token=self._stop_ids or None
            )
        return self._ll_tokenizer

    def matcher(self, spec: ConstraintSpec) -> TurnMatcher:
        """A fresh matcher for ``spec`` (compiled now unless cached); ``ValueError`` when it does not compile."""
        with self._lock:
            pristine = self._compiled.get(spec.key)
            if pristine is not None:
                self._compiled.move_to_end(spec.key)
                return TurnMatcher(pristine.deep_copy())
            tokenizer = self._tokenizer()
        pristine = self._compile(spec, tokenizer)  # outside the lock: llguidance drops the GIL while it compiles
        with self._lock:
            self.compiles += 1
            self._compiled[spec.key] = pristine
            self._compiled.move_to_end(spec.key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return TurnMatcher(pristine.deep_copy())

    @staticmethod
    def _compile(spec: ConstraintSpec, tokenizer: Any) -> Any:
        import llguidance

        matcher_type = llguidance.LLMatcher
        what = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar"}
        try:
            if spec.kind in ("json_schema", "json_object"):
                # Strict: a schema keyword the compiler does not know is an error, not silently ignored.
                options: Any = {**_JSON_LAYOUT, "lenient": not spec.strict}
                grammar = matcher_type.grammar_from_json_schema(spec.source, defaults=options)
            elif spec.kind == "regex":
                grammar = matcher_type.grammar_from_regex(spec.source)
            elif spec.syntax == "gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = matcher_type.grammar_from_lark(gbnf_to_lark(spec.source))
            else:
                grammar = matcher_type.grammar_from_lark(spec.source)
        except Exception as err:  # the converters raise their own types for the user's text
            raise _refuse(f"the {what[spec.kind]} does not compile: {str(err)[:_ERROR_CHARS]}") from None
        matcher = matcher_type(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise _refuse(f"the {what[spec.kind]} does not compile: {str(matcher.get_error())[:_ERROR_CHARS]}")
        return matcher


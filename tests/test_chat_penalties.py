"""Presence, frequency and repetition penalties in the chat engine, pass by pass, without Triton.

The reference is a plain greedy loop over ``transformers``' GPT-2 on the same demo weights and the same prompt ids:
at each step the logits of the whole sequence so far, the repetition penalty as Hugging Face applies it (a token in
the prompt or the reply: divided where positive, multiplied where not), then OpenAI's frequency and presence
penalties (counts of the reply's tokens), then the argmax. The engine keeps the counts per row on the device; a
batch of rows with different penalties must give each row its own reference reply.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from test_chat_engine import DEMO, Rig, Sender

TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> Any:
    model = transformers.GPT2LMHeadModel.from_pretrained(DEMO, torch_dtype=torch.float32)
    model.eval()
    return model


def greedy_reference(model: Any, prompt: list[int], stop: frozenset[int], *, presence: float = 0.0,
                     frequency: float = 0.0, repetition: float = 1.0, tokens: int = TOKENS) -> list[int]:
    ids = list(prompt)
    reply: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([ids])).logits[0, -1, :4096].clone()
            seen = torch.zeros(4096, dtype=torch.bool)
            seen[torch.tensor(ids)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
            counts = torch.bincount(torch.tensor(reply, dtype=torch.long), minlength=4096).float() if reply else (
                torch.zeros(4096))
            logits = logits - counts * frequency - (counts > 0).float() * presence
            token = int(logits.argmax())
            if token in stop:
                break
            reply.append(token)
            ids.append(token)
    return reply


def reply_ids(rig: Rig, sender: Sender) -> list[int]:
    return rig.tokenizer.encode(sender.reply.decode())


PENALTIES = [
    {"repetition_penalty": 1.6},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 0.8},
    {},
]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_a_penalised_greedy_reply_equals_the_reference_loop(reference: Any, penalties: dict[str, float]) -> None:
    rig = Rig(DEMO, max_ctx=512)
    rig.turn(1, ["user"], ["Tell me about the house and the garden."], max_tokens=TOKENS, **penalties)
    turn = rig.turns[1]
    assert turn.prompt is not None
    want = greedy_reference(reference, turn.prompt.ids, rig.tokenizer.stop_ids,
                            presence=penalties.get("presence_penalty", 0.0),
                            frequency=penalties.get("frequency_penalty", 0.0),
                            repetition=penalties.get("repetition_penalty", 1.0))
    assert turn.reply_ids == want


def test_penalties_change_the_reply_and_stay_with_their_row() -> None:
    """Rows with different penalties in one batch give each its solo reply; a plain turn after a penalised one in
    the same slot is plain again (the counts and penalties of a slot are reset when a turn joins it)."""
    jobs = [(k, PENALTIES[k % len(PENALTIES)]) for k in range(1, 9)]
    rig = Rig(DEMO, slots=16, max_ctx=512)
    together = [rig.submit(k, ["user"], ["Tell me about the garden."], max_tokens=TOKENS, **p) for k, p in jobs]
    rig.run(*together)
    for (k, p), sender in zip(jobs, together, strict=True):
        alone = Rig(DEMO, max_ctx=512).turn(1, ["user"], ["Tell me about the garden."], max_tokens=TOKENS, **p)
        assert sender.reply == alone.reply, (k, p)
    plain = Rig(DEMO, max_ctx=512).turn(1, ["user"], ["Tell me about the garden."], max_tokens=TOKENS).reply
    assert {s.reply for s in together} - {plain}  # some penalty changed something
    # The same slots, now without penalties: every reply is the plain one.
    rig.run(*[rig.submit(k, end=True) for k, _ in jobs])
    again = [rig.submit(100 + k, ["user"], ["Tell me about the garden."], max_tokens=TOKENS) for k, _ in jobs]
    rig.run(*again)
    assert all(s.reply == plain for s in again)


def test_a_sampled_penalised_turn_repeats_itself_with_its_seed() -> None:
    options = {"temperature": 1.0, "seed": 42, "frequency_penalty": 1.0, "repetition_penalty": 1.2}
    first = Rig(DEMO).turn(1, ["user"], ["Where?"], max_tokens=TOKENS, **options)
    rig = Rig(DEMO, slots=4)
    others = [rig.submit(k, ["user"], ["Who?"], max_tokens=TOKENS, temperature=0.7, seed=k) for k in (2, 3)]
    mine = rig.submit(1, ["user"], ["Where?"], max_tokens=TOKENS, **options)
    rig.run(mine, *others)
    assert mine.reply == first.reply


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"presence_penalty": 2.5}, "PRESENCE_PENALTY must be in -2..2"),
        ({"frequency_penalty": float("nan")}, "FREQUENCY_PENALTY must be in -2..2"),
        ({"repetition_penalty": 0.0}, "REPETITION_PENALTY must be in (0, 10]"),
        ({"repetition_penalty": float("inf")}, "REPETITION_PENALTY must be in (0, 10]"),
    ],
)
def test_absurd_penalties_are_refused_naming_them(options: dict[str, float], says: str) -> None:
    rig = Rig(DEMO)
    with pytest.raises(ValueError, match=rf"{says.split(' must')[0]}") as err:
        rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], **options)
    assert says in str(err.value)

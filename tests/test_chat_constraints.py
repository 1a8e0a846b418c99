"""Constrained decoding in the chat engine (server/chat/_constraints.py), pass by pass, without Triton.

The packaged demo GPT-2 writes near gibberish on its own, so a reply that parses and validates does so because of
the constraint. Each property is checked over many seeded turns (sampled, so each turn explores other tokens):
every JSON-schema reply parses and validates, every regex reply matches whole, a batch gives each row's solo reply,
a turn N gives what its history sent whole gives (the stateless twin), a cancelled constrained turn leaves nothing
behind, and a constraint that does not compile is the request's error before any token. Through a real Triton and
the SDK: tests/test_chat_client.py (response_format).
"""

from __future__ import annotations

import json
import os
import random
import re
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from test_chat_engine import DEMO, Rig, Sender, text

from triton_npu_client.server.chat._constraints import Constraints, ConstraintSpec, fill_masks, parse_constraint
from triton_npu_client.server.chat._sampling import SamplingFlags, allowed_ids, sample

SEED = int(os.environ.get("TNC_SEED", random.SystemRandom().randrange(1 << 30)))

#: Schemas whose every valid reply is short (strings and arrays bounded, integers in ranges), so a reply always
#: completes within its max_tokens: what is tested is that it is valid, not how long the model rambles.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "perhaps"]},
            "sure": {"type": "boolean"},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99}, "maxItems": 3},
        },
        "required": ["answer", "sure", "scores"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "where": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                               "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["city", "where", "note"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
]
REGEXES = [
    r"(yes|no), [a-z]{2,8}\.",
    r"[0-9]{3}-[0-9]{4}",
    r"[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10}){0,2}",
    r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
]
QUESTIONS = ["Tell me about her.", "Where is the house?", "What did she say?", "Who came to dinner?"]


def schema_constraint(schema: dict[str, Any]) -> str:
    return json.dumps({"type": "json_schema", "schema": schema, "strict": True})


def regex_constraint(pattern: str) -> str:
    return json.dumps({"type": "regex", "pattern": pattern})


@pytest.fixture(scope="module")
def rig() -> Rig:
    return Rig(DEMO, slots=32, max_ctx=1024, default_max_tokens=64, blocks=1024)


def run_all(rig: Rig, jobs: list[tuple[int, list[str], list[str], dict[str, Any]]]) -> list[Sender]:
    senders = [rig.submit(key, roles, texts, **options) for key, roles, texts, options in jobs]
    rig.run(*senders)
    for s in senders:
        assert s.refusal is None, s.refusal
    return senders


def close_all(rig: Rig, keys: list[int]) -> None:
    closes = [rig.submit(k, end=True) for k in keys]
    rig.run(*closes)


def test_every_json_schema_reply_parses_and_validates_over_200_seeded_turns(rig: Rig) -> None:
    """200 sampled turns (16 at a time), each under one of the schemas: all end by the schema's completion and
    validate; the demo model alone would write prose."""
    print(f"TNC_SEED={SEED}")
    rng = random.Random(SEED)
    done = 0
    key = 1000
    while done < 200:
        jobs = []
        picks = []
        for _ in range(16):
            schema = rng.choice(SCHEMAS)
            picks.append(schema)
            options = {"constraint": schema_constraint(schema), "temperature": rng.choice([0.0, 0.7, 1.0, 1.5]),
                       "seed": rng.randrange(1 << 40), "max_tokens": 160}
            jobs.append((key, ["user"], [rng.choice(QUESTIONS)], options))
            key += 1
        senders = run_all(rig, jobs)
        for schema, sender in zip(picks, senders, strict=True):
            reply = text(sender)
            assert sender.last.finish == "stop", (reply, sender.last.finish)
            jsonschema.validate(json.loads(reply), schema)
        close_all(rig, [k for k, *_ in jobs])
        done += len(jobs)
    # Four distinct schemas: each compiled once, whatever the number of turns.
    assert rig.engine.constraints.compiles <= len(SCHEMAS) + len(REGEXES) + 4


def test_every_regex_reply_matches_whole_over_200_seeded_turns(rig: Rig) -> None:
    print(f"TNC_SEED={SEED}")
    rng = random.Random(SEED + 1)
    key = 5000
    for _ in range(200 // 20):
        jobs, picks = [], []
        for _ in range(20):
            pattern = rng.choice(REGEXES)
            picks.append(pattern)
            options = {"constraint": regex_constraint(pattern), "temperature": rng.choice([0.0, 0.8, 1.3]),
                       "seed": rng.randrange(1 << 40), "max_tokens": 80}
            jobs.append((key, ["user"], [rng.choice(QUESTIONS)], options))
            key += 1
        senders = run_all(rig, jobs)
        for pattern, sender in zip(picks, senders, strict=True):
            reply = text(sender)
            assert re.fullmatch(pattern, reply), (pattern, reply)
            assert sender.last.finish == "stop"
        close_all(rig, [k for k, *_ in jobs])


def test_json_object_replies_are_json_object_prefixes() -> None:
    """The demo's free JSON objects never close within their cap (it writes long keys and values of prose); each
    reply is still the beginning of a JSON object: a fresh matcher for any JSON object takes its bytes whole."""
    from triton_npu_client.server import CheckpointTokenizer

    rig = Rig(DEMO, slots=8, max_ctx=1024, default_max_tokens=64)
    senders = run_all(rig, [(k, ["user"], ["Tell me."], {"constraint": '{"type":"json_object"}', "max_tokens": 60,
                                                          "temperature": 0.9, "seed": k}) for k in range(1, 7)])
    tokenizer = CheckpointTokenizer(DEMO)
    constraints = Constraints(tokenizer)
    for s in senders:
        reply = text(s)
        assert reply.startswith("{")
        assert s.last.finish in ("stop", "length")
        checker = constraints.matcher(parse_constraint('{"type":"json_object"}'))
        assert all(checker.consume(t) for t in tokenizer.encode(reply)), reply

def test_a_batch_gives_each_rows_solo_reply_with_constraints_on_some_rows() -> None:
    """Eight turns decoded together (constrained and not, greedy and sampled) equal each run alone, byte for byte;
    the unconstrained rows equal themselves with no constrained row in the batch."""
    rng = random.Random(SEED + 2)
    jobs = []
    for k in range(1, 9):
        options: dict[str, Any] = {"max_tokens": 40, "temperature": rng.choice([0.0, 0.9]), "seed": k * 7}
        if k % 3 == 0:
            options["constraint"] = regex_constraint(rng.choice(REGEXES))
        elif k % 3 == 1:
            options["constraint"] = schema_constraint(rng.choice(SCHEMAS))
        jobs.append((k, ["system", "user"], [f"You are {k}.", rng.choice(QUESTIONS)], options))
    together = [s.reply for s in run_all(Rig(DEMO, slots=16, max_ctx=512), jobs)]
    alone = [run_all(Rig(DEMO, slots=2, max_ctx=512), [job])[0].reply for job in jobs]
    assert together == alone
    plain = [job for job in jobs if "constraint" not in job[3]]
    only_plain = [s.reply for s in run_all(Rig(DEMO, slots=16, max_ctx=512), plain)]
    assert only_plain == [r for job, r in zip(jobs, together, strict=True) if "constraint" not in job[3]]


def test_turn_three_with_a_constraint_equals_its_history_sent_whole() -> None:
    """The stateless twin: constrained turns kept in the history, turn 3 equals a fresh conversation given it."""
    rig = Rig(DEMO, max_ctx=1024, share_prefixes=False)
    history: list[tuple[str, str]] = [("system", "Answer in JSON.")]
    replies = []
    for i, q in enumerate(QUESTIONS[:3]):
        options = {"constraint": schema_constraint(SCHEMAS[i % len(SCHEMAS)]), "max_tokens": 120,
                   "temperature": 0.8, "seed": 11 + i}
        roles, texts = (["system", "user"], ["Answer in JSON.", q]) if i == 0 else (["user"], [q])
        sender = rig.turn(1, roles, texts, **options)
        replies.append(sender)
        history.append(("user", q))
        if i < 2:
            history.append(("assistant", text(sender)))
    fresh = rig.turn(2, [r for r, _ in history], [t for _, t in history],
                     constraint=schema_constraint(SCHEMAS[2]), max_tokens=120, temperature=0.8, seed=13)
    assert fresh.reply == replies[2].reply
    jsonschema.validate(json.loads(text(fresh)), SCHEMAS[2])
    assert replies[2].last.prompt_tokens < fresh.last.prompt_tokens


@pytest.mark.parametrize("at_piece", [1, 3, 6])
def test_a_cancelled_constrained_turn_leaves_no_trace(at_piece: int) -> None:
    """Cancelled after some pieces, a constrained turn is rolled back with its matcher: the next turn (with the same
    constraint) equals that of a conversation that never had the cancelled turn."""
    schema = schema_constraint(SCHEMAS[0])
    rig = Rig(DEMO, max_ctx=1024, cancel_check_every=1)
    rig.turn(1, ["system", "user"], ["Be brief.", QUESTIONS[0]], constraint=schema, max_tokens=80)
    victim = rig.submit(1, ["user"], [QUESTIONS[1]], constraint=schema, max_tokens=80, temperature=1.0, seed=5)
    while len(victim.chat) < at_piece and not victim.done:
        rig.loop.run_pass()
    assert not victim.done
    victim.cancel = True
    rig.run(victim)
    assert victim.chat[-1].finish == ""
    after = rig.turn(1, ["user"], [QUESTIONS[2]], constraint=schema, max_tokens=80, temperature=1.0, seed=6)

    ref = Rig(DEMO, max_ctx=1024)
    ref.turn(1, ["system", "user"], ["Be brief.", QUESTIONS[0]], constraint=schema, max_tokens=80)
    want = ref.turn(1, ["user"], [QUESTIONS[2]], constraint=schema, max_tokens=80, temperature=1.0, seed=6)
    assert after.reply == want.reply
    jsonschema.validate(json.loads(text(after)), SCHEMAS[0])


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        ('{"type": "regex", "pattern": "[a-"}', "regex does not compile"),
        ('{"type": "grammar", "grammar": "start: undefined_rule"}', "grammar does not compile"),
        ('{"type": "json_schema", "schema": {"type": "wibble"}}', "JSON schema does not compile"),
        ('{"type": "json_schema"}', "needs 'schema'"),
        ('{"type": "xml"}', "'type' must be one of"),
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"type": "json_schema", "schema": ' + "[" * 30000 + "]" * 30000 + "}", "nested too deeply"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_before_any_token(constraint: str, says: str) -> None:
    rig = Rig(DEMO)
    with pytest.raises(ValueError, match="CONSTRAINT") as err:
        rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], constraint=constraint)
    assert says in str(err.value)
    # The engine is untouched: a plain turn runs, and so does a good constraint.
    assert rig.turn(1, ["user"], ["hi"]).reply
    assert re.fullmatch("[0-9]{3}", text(rig.turn(2, ["user"], ["hi"], constraint=regex_constraint("[0-9]{3}"))))


def test_a_constraint_over_its_cap_is_refused_before_it_is_parsed() -> None:
    rig = Rig(DEMO)
    huge = json.dumps({"type": "regex", "pattern": "a" * 70_000})
    with pytest.raises(ValueError, match="max_constraint_bytes"):
        rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], constraint=huge)


def test_the_compiled_constraints_are_an_lru_of_their_capacity() -> None:
    from triton_npu_client.server import CheckpointTokenizer

    constraints = Constraints(CheckpointTokenizer(DEMO), capacity=2)
    specs = [parse_constraint(regex_constraint(p)) for p in REGEXES[:3]]
    for spec in (specs[0], specs[1], specs[0], specs[2], specs[0], specs[1]):
        constraints.matcher(spec)
    # 0, 1 compiled; 0 hit; 2 compiled (1 dropped, 0 was used after it); 0 hit; 1 compiled again.
    assert constraints.compiles == 4
    assert isinstance(specs[0], ConstraintSpec)
    assert specs[0].kind == "regex"


def test_equal_schemas_spelled_differently_share_one_compile_and_keep_their_property_order() -> None:
    a = parse_constraint('{"type":"json_schema","schema":{"type":"object","required":["a"]}}')
    b = parse_constraint('{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", '
                         '"required": ["a"]}}}')
    assert a.key == b.key
    # Property order is meaning (the reply writes them in it): a reordered schema is another constraint.
    c = parse_constraint('{"type":"json_schema","schema":{"required":["a"],"type":"object"}}')
    assert c.key != a.key


def test_a_reply_writes_the_properties_in_the_schemas_order() -> None:
    rig = Rig(DEMO)
    for order in (["name", "age"], ["age", "name"]):
        schema = {"type": "object", "properties": {k: SCHEMAS[0]["properties"][k] for k in order},
                  "required": order, "additionalProperties": False}
        reply = json.loads(text(rig.turn(len(order[0]), ["user"], ["Who?"], constraint=schema_constraint(schema),
                                         max_tokens=60)))
        assert list(reply) == order


def test_the_sampler_draws_only_allowed_ids_and_leaves_unconstrained_rows_alone() -> None:
    """Batched masking on the device: each row's pick is among its allowed ids; a row with every bit set samples as
    without masks; a row allowed nothing fails (-1) alone."""
    gen = torch.Generator().manual_seed(SEED)
    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab, generator=gen)
    words = -(-vocab // 32)
    masks = np.full((rows, words), -1, dtype=np.int32)
    allowed_sets = {0: [5, 17, 299], 1: [0], 2: list(range(40, 80)), 4: []}
    for row, ids in allowed_sets.items():
        masks[row] = 0
        for i in ids:
            masks[row, i // 32] |= np.int32(np.uint32(1 << (i % 32)).view(np.int32))
    mask_t = torch.from_numpy(masks)
    assert allowed_ids(mask_t, vocab)[0].nonzero().flatten().tolist() == [5, 17, 299]
    common = {"top_k": torch.zeros(rows, dtype=torch.long), "top_p": torch.ones(rows),
              "seeds": torch.arange(rows), "positions": torch.full((rows,), 3), "below_min": torch.zeros(rows,
                                                                                                        dtype=bool),
              "stop_ids": torch.tensor([], dtype=torch.long)}
    for temperature in (0.0, 1.0):
        temp = torch.full((rows,), temperature)
        flags = SamplingFlags(sampled=temperature > 0, constrained=True)
        ids = sample(logits, temperature=temp, flags=flags, masks=mask_t, **common).tolist()
        plain = sample(logits, temperature=temp, flags=SamplingFlags(sampled=temperature > 0), **common).tolist()
        for row, ids_allowed in allowed_sets.items():
            if ids_allowed:
                assert ids[row] in ids_allowed
            else:
                assert ids[row] == -1
        assert ids[3] == plain[3]
        assert ids[5] == plain[5]
    assert fill_masks([None, None], 4).tolist() == [[-1] * 4, [-1] * 4]


def test_max_tokens_0_runs_to_the_end_of_the_context_without_dropping_history() -> None:
    """No cap: the reply may run until the context is full (FINISH context) and the history is kept as for the
    engine's default cap."""
    rig = Rig(DEMO, max_ctx=96, default_max_tokens=8)
    rig.turn(1, ["system", "user"], ["Be brief.", QUESTIONS[0]], max_tokens=4)
    sender = rig.turn(1, ["user"], [QUESTIONS[1]], max_tokens=0, min_tokens=0)
    assert sender.last.dropped == 0
    assert sender.last.finish in ("stop", "context")
    capped = Rig(DEMO, max_ctx=96, default_max_tokens=8)
    capped.turn(1, ["system", "user"], ["Be brief.", QUESTIONS[0]], max_tokens=4)
    assert sender.last.tokens >= capped.turn(1, ["user"], [QUESTIONS[1]], max_tokens=8).last.tokens
    long_one = Rig(DEMO, max_ctx=96).turn(1, ["user"], [QUESTIONS[1]], max_tokens=0, min_tokens=90)
    assert long_one.last.finish == "context"
    assert long_one.last.context_tokens == 96


def test_the_samplers_noise_is_positive_for_every_id() -> None:
    """Exp(1) noise of zero would make its id win every race (or NaN where masked out): it must never be 0 or inf.
    4096 rows x 4096 ids: the old 24-bit draw gave a zero about once per 4096 rows."""
    from triton_npu_client.server.chat._sampling import exponential_noise

    seeds = torch.arange(4096) * 7919 + SEED
    noise = exponential_noise(seeds, torch.arange(4096), 4096)
    assert bool((noise > 0).all())
    assert bool(torch.isfinite(noise).all())
    # Still Exp(1): mean 1 within a few standard errors (1/sqrt(16M)).
    assert abs(noise.double().mean().item() - 1.0) < 2e-3

"""Tool calling in the chat engine (TOOLS, TOOL_CHOICE, TOOL_META in; TOOL_CALLS out), pass by pass, without Triton.

The packaged demo GPT-2 has a Hermes-style ``tool_use`` template (tools in the system turn, calls as
``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``); its free text is near gibberish, so it calls a tool only when
``tool_choice`` forces one, and a forced call is valid because the constraint makes it so. The properties: over 200
seeded forced turns every call is valid JSON for its function's schema; a batch gives each row's solo reply with
tools on; turn N equals its history sent whole (the stateless twin), call ids included; a tool result continues the
conversation on the device; a cancelled forced turn leaves nothing; a streamed reply never shows call markup; every
bad tool input is refused before any token, naming the input. Then two tiny checkpoints with the real Llama 3.2 and
Qwen2.5 templates: the engine's prompt ids equal transformers' ``apply_chat_template(tools=...)`` at every turn, and
scripted replies in each family's format come back as the calls vLLM's parser for that family documents.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from test_chat_engine import DEMO, Rig, Sender, text

from tests._checkpoints import write_tiny_llama

SEED = int(os.environ.get("TNC_SEED", random.SystemRandom().randrange(1 << 30)))
TEMPLATES = Path(__file__).resolve().parent / "templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, for some days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ROLL = {
    "type": "function",
    "function": {
        "name": "roll_dice",
        "parameters": {
            "type": "object",
            "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20},
                           "count": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["sides"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "what_time_is_it", "description": "The time now"}}
TOOLS = [WEATHER, ROLL, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS}
QUESTIONS = ["Weather in Bath?", "Roll for me.", "What now?", "Tell me about her."]


def named(name: str) -> str:
    return json.dumps({"type": "function", "function": {"name": name}})


def calls_of(sender: Sender) -> list[dict[str, Any]]:
    raw = sender.last.tool_calls
    return json.loads(raw) if raw else []


def meta(**fields: Any) -> str:
    return json.dumps(fields)


def check_calls(calls: list[dict[str, Any]], allowed: set[str]) -> None:
    assert calls, "a forced turn made no call"
    for call in calls:
        assert call["name"] in allowed, call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert call["id"].startswith("call_"), call
        assert len(call["id"]) == 29, call


def test_every_forced_call_is_valid_for_its_schema_over_200_seeded_turns() -> None:
    """200 sampled turns, 50 at a time, each forced (required: any tool; or one named): every reply is a call of an
    allowed tool whose arguments validate, the turn ends with the call (FINISH stop), and no markup reached the
    client as text."""
    print(f"TNC_SEED={SEED}")
    rng = random.Random(SEED)
    # The demo's 4,096-id vocabulary spells markup in many tokens: a call takes 40 to 80.
    # 50 at a time: the passes, not the rows, are what the test pays for.
    rig = Rig(DEMO, slots=64, max_ctx=1024, default_max_tokens=200, blocks=4096)
    key = 1
    for _ in range(4):
        senders, allowed = [], []
        for _ in range(50):
            choice = rng.choice(["required", "get_weather", "roll_dice", "what_time_is_it"])
            allowed.append({t["function"]["name"] for t in TOOLS} if choice == "required" else {choice})
            options = {"tools": json.dumps(TOOLS), "tool_choice": choice if choice == "required" else named(choice),
                       "temperature": rng.choice([0.0, 0.7, 1.0, 1.5]), "seed": rng.randrange(1 << 40)}
            senders.append(rig.submit(key, ["user"], [rng.choice(QUESTIONS)], end=True, **options))
            key += 1
        rig.run(*senders)
        for sender, names in zip(senders, allowed, strict=True):
            assert sender.refusal is None, sender.refusal
            assert sender.last.finish == "stop"
            assert text(sender) == ""  # the reply is the call alone, and none of it was shown as text
            check_calls(calls_of(sender), names)


def tool_conversation(rig: Rig, key: int, *, seed: int) -> list[Sender]:
    """Three turns: a forced call, its result (auto: the demo answers in text), another forced call."""
    tools = json.dumps(TOOLS)
    one = rig.turn(key, ["system", "user"], ["Use the tools.", QUESTIONS[0]], tools=tools,
                   tool_choice=named("get_weather"), temperature=0.9, seed=seed, max_tokens=200)
    call = calls_of(one)[0]
    two = rig.turn(key, ["tool"], ["22 C, sunny"], tools=tools, tool_meta=[meta(tool_call_id=call["id"])],
                   temperature=0.9, seed=seed + 1, max_tokens=24)
    three = rig.turn(key, ["user"], [QUESTIONS[1]], tools=tools, tool_choice="required", temperature=0.9,
                     seed=seed + 2, max_tokens=200)
    return [one, two, three]


def test_a_tool_result_continues_on_the_device_and_turn_three_equals_its_history_sent_whole() -> None:
    rig = Rig(DEMO, max_ctx=1024, share_prefixes=False)
    one, two, three = tool_conversation(rig, 1, seed=SEED % 1000)
    # The result turn prefills the result and the template's framing of it (plus what the template renders of the
    # call differently from the tokens the constrained reply took), never the history again.
    assert two.last.prompt_tokens < one.last.prompt_tokens / 2, (two.last.prompt_tokens, one.last.prompt_tokens)
    check_calls(calls_of(three), {"get_weather", "roll_dice", "what_time_is_it"})

    # The stateless twin: the same three turns' history sent whole, as a first turn.
    call = calls_of(one)[0]
    roles = ["system", "user", "assistant", "tool", "assistant", "user"]
    texts = ["Use the tools.", QUESTIONS[0], "", "22 C, sunny", text(two), QUESTIONS[1]]
    metas = ["", "", meta(tool_calls=[call]), meta(tool_call_id=call["id"]), "", ""]
    fresh = Rig(DEMO, max_ctx=1024, share_prefixes=False).turn(
        9, roles, texts, tools=json.dumps(TOOLS), tool_meta=metas, tool_choice="required", temperature=0.9,
        seed=SEED % 1000 + 2, max_tokens=200,
    )
    assert calls_of(fresh) == calls_of(three)  # ids too: they are salted with the prompt, which is the same
    assert fresh.last.digest != three.last.digest  # (different chains: one turn against three)


def test_the_digest_chains_tool_fields_as_the_protocol_spells_them() -> None:
    from triton_npu_client._protocol import EMPTY, digest_role, history_digest

    rig = Rig(DEMO, max_ctx=1024)
    one, two, _ = tool_conversation(rig, 1, seed=3)
    call = calls_of(one)[0]
    d1 = history_digest(EMPTY, [("system", "Use the tools."), ("user", QUESTIONS[0])], "",
                        [(call["id"], call["name"], call["arguments"])])
    assert one.last.digest == d1
    d2 = history_digest(d1, [(digest_role("tool", tool_call_id=call["id"]), "22 C, sunny")], text(two))
    assert two.last.digest == d2


def test_a_batch_with_tools_gives_each_rows_solo_reply() -> None:
    rng = random.Random(SEED + 1)
    jobs = []
    for k in range(1, 9):
        options: dict[str, Any] = {"max_tokens": 60, "temperature": rng.choice([0.0, 0.9]), "seed": k * 7}
        if k % 3 == 0:
            options |= {"tools": json.dumps(TOOLS), "tool_choice": "required"}
        elif k % 3 == 1:
            options |= {"tools": json.dumps(TOOLS)}  # auto: the demo writes text, read for calls
        jobs.append((k, ["user"], [rng.choice(QUESTIONS)], options))

    def run(rig: Rig, chosen: list[Any]) -> list[tuple[bytes, str]]:
        senders = [rig.submit(k, r, t, **o) for k, r, t, o in chosen]
        rig.run(*senders)
        return [(s.reply, s.last.tool_calls) for s in senders]

    together = run(Rig(DEMO, slots=16, max_ctx=1024, blocks=1024), jobs)
    alone = [run(Rig(DEMO, slots=2, max_ctx=1024), [job])[0] for job in jobs]
    assert together == alone
    assert all(calls for (_, calls), job in zip(together, jobs, strict=True) if job[3].get("tool_choice"))


@pytest.mark.parametrize("at_pass", [1, 4, 9])
def test_a_cancelled_forced_call_leaves_no_trace(at_pass: int) -> None:
    tools = json.dumps(TOOLS)
    rig = Rig(DEMO, max_ctx=1024, cancel_check_every=1)
    rig.turn(1, ["user"], [QUESTIONS[0]], tools=tools, tool_choice=named("get_weather"), max_tokens=200)
    victim = rig.submit(1, ["user"], [QUESTIONS[1]], tools=tools, tool_choice="required", max_tokens=200,
                        temperature=1.0, seed=5)
    for _ in range(at_pass):
        rig.loop.run_pass()
    assert not victim.done
    victim.cancel = True
    rig.run(victim)
    # A forced call shows nothing while it is written, so the cancelled turn sent no piece, and no call.
    assert victim.done
    assert all(r.finish == "" and r.tool_calls == "" for r in victim.chat)
    after = rig.turn(1, ["user"], [QUESTIONS[2]], tools=tools, tool_choice="required", max_tokens=200,
                     temperature=1.0, seed=6)

    ref = Rig(DEMO, max_ctx=1024)
    ref.turn(1, ["user"], [QUESTIONS[0]], tools=tools, tool_choice=named("get_weather"), max_tokens=200)
    want = ref.turn(1, ["user"], [QUESTIONS[2]], tools=tools, tool_choice="required", max_tokens=200,
                    temperature=1.0, seed=6)
    assert calls_of(after) == calls_of(want)
    assert after.last.digest == want.last.digest


def scripted(reply: str) -> str:
    """A grammar whose one sentence is ``reply``: the model writes exactly it (a scripted reply, token by token)."""
    return json.dumps({"type": "grammar", "syntax": "lark", "grammar": f"start: {json.dumps(reply)}"})


def test_a_streamed_reply_shows_its_content_and_never_a_call() -> None:
    """A reply of text then two calls, every token its own response: the pieces are the text alone; the calls come on
    the last response; the history keeps the text and the calls (the next turn renders them)."""
    reply = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath", "days": 2}}\n'
             '</tool_call>\n<tool_call>\n{"name": "roll_dice", "arguments": {"sides": 6}}\n</tool_call>')
    rig = Rig(DEMO, max_ctx=1024)
    sender = rig.turn(1, ["user"], [QUESTIONS[0]], tools=json.dumps(TOOLS), constraint=scripted(reply),
                      max_tokens=200)
    pieces = [r.piece for r in sender.chat if r.piece]
    assert len(pieces) > 1
    assert b"".join(pieces) == b"Let me look. "
    assert all(b"<tool" not in p and b"{" not in p for p in pieces)
    calls = calls_of(sender)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Bath", "days": 2}), ("roll_dice", {"sides": 6})]
    assert len({c["id"] for c in calls}) == 2
    history = next(iter(rig.engine._conversations.values())).messages
    assert history[-1].content == "Let me look. "  # type: ignore[union-attr]
    assert [c.name for c in history[-1].tool_calls] == ["get_weather", "roll_dice"]  # type: ignore[union-attr]


def test_tool_choice_none_and_no_tools_leave_markup_as_text() -> None:
    reply = '<tool_call>\n{"name": "roll_dice", "arguments": {"sides": 6}}\n</tool_call>'
    rig = Rig(DEMO, max_ctx=1024)
    for options in ({"tools": json.dumps(TOOLS), "tool_choice": "none"}, {}):
        sender = rig.turn(len(options) + 1, ["user"], ["Roll."], constraint=scripted(reply), max_tokens=100, **options)
        assert text(sender) == reply
        assert sender.last.tool_calls == ""


def test_malformed_markup_is_content_whole() -> None:
    reply = 'So: <tool_call>\n{"name": "roll_dice", "arguments": [6]}\n</tool_call>'
    sender = Rig(DEMO, max_ctx=1024).turn(1, ["user"], ["Roll."], tools=json.dumps(TOOLS), constraint=scripted(reply),
                                          max_tokens=100)
    assert text(sender) == reply
    assert sender.last.tool_calls == ""


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ({"tools": "not json"}, "TOOLS: expected a JSON array"),
        ({"tools": '{"type": "function"}'}, "TOOLS: expected a JSON array of tools, given a JSON dict"),
        ({"tools": '[{"type": "function", "function": {}}]'}, "TOOLS: tools[0].function.name"),
        ({"tools": json.dumps([WEATHER, WEATHER])}, "two tools are named 'get_weather'"),
        ({"tools": "[" * 20000 + "]" * 20000}, "nested too deeply"),
        ({"tools": json.dumps(TOOLS), "tool_choice": named("fly")}, "TOOL_CHOICE: tool_choice names 'fly'"),
        ({"tools": json.dumps(TOOLS), "tool_choice": "sometimes"}, "TOOL_CHOICE: expected auto, none, required"),
        ({"tool_choice": "required"}, "TOOL_CHOICE: tool_choice \"required\" needs at least one tool"),
        ({"tool_choice": named("x")}, "TOOL_CHOICE"),
        ({"tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "wibble"}}}]),
          "tool_choice": "required"}, "TOOLS: a function's parameters"),
        ({"tool_meta": ["", ""]}, "TOOL_META has 2 entries but ROLE has 1"),
        ({"tool_meta": [meta(tool_calls=[{"name": "f", "arguments": "{}"}])]}, "belong to an assistant message"),
        ({"tool_meta": [meta(tool_call_id="x")]}, "tool_call_id belongs to a tool message"),
        ({"tool_meta": [meta(colour="red")]}, "unknown field 'colour'"),
        ({"tool_meta": ["{"]}, "TOOL_META[0]: expected a JSON object"),
        ({"tools": "[" + " " * 70_000 + "]"}, "max_tools_bytes"),
    ],
)
def test_bad_tool_inputs_name_the_input_before_any_token(inputs: dict[str, Any], says: str) -> None:
    rig = Rig(DEMO, max_ctx=1024)
    with pytest.raises(ValueError, match=re.escape(says)):
        rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], **inputs)
    assert rig.turn(1, ["user"], ["hi"], tools=json.dumps(TOOLS)).reply  # the engine goes on


def test_a_turn_ends_with_a_user_or_tool_message_and_calls_are_checked() -> None:
    rig = Rig(DEMO)
    with pytest.raises(ValueError, match="ROLE user or tool, got 'assistant'"):
        rig.engine.parse(start=True, end=False, roles=["user", "assistant"], texts=["hi", "hello"])
    bad = meta(tool_calls=[{"id": "a", "name": "f", "arguments": "[1]"}])
    with pytest.raises(ValueError, match=r"TOOL_META\[1\].tool_calls\[0\]: .*must be a JSON object"):
        rig.engine.parse(start=True, end=False, roles=["user", "assistant", "user"], texts=["a", "", "b"],
                         tool_meta=["", bad, ""])


def test_tools_on_a_template_that_takes_none_are_refused_with_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    shutil.copytree(DEMO, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # The demo's template from before tools: it never reads them.
    config["chat_template"] = (
        "{%- for message in messages %}{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    rig = Rig(folder)
    with pytest.raises(ValueError, match=r"TOOLS: this checkpoint's chat template .* does not read tools"):
        rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], tools=json.dumps(TOOLS))


# -- real templates: Llama 3.2 and Qwen2.5 --------------------------------------------------------------------------

REAL = {
    "llama": ("meta-llama-Llama-3.2-3B-Instruct.jinja", ("<|python_tag|>", "<|eom_id|>")),
    "qwen2": ("Qwen-Qwen2.5-7B-Instruct.jinja", ()),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family, (name, _) in REAL.items():
        template = (TEMPLATES / name).read_text(encoding="utf-8")
        # Room for the templates' tool prompts, which a 400-id vocabulary spells in about 1,500 tokens.
        out[family] = write_tiny_llama(tmp_path_factory.mktemp(family), family, chat_template=template, seed=3,
                                       max_position_embeddings=4096)
    return out


def hf_prompt(folder: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    import transformers

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]


@pytest.mark.parametrize("family", list(REAL))
def test_a_real_checkpoint_served_with_tools_prompts_as_transformers_and_calls_validly(
    served: dict[str, Path], family: str
) -> None:
    """Turn 1 (a forced call) and turn 2 (its result): the engine's prompt ids equal transformers' for the same
    conversation with the same tools; the forced call validates."""
    folder = served[family]
    rig = Rig(folder, max_ctx=4096, default_max_tokens=100, blocks=1024)
    tools = [WEATHER, ROLL]
    one = rig.turn(1, ["system", "user"], ["Be brief.", "Weather in Bath?"], tools=json.dumps(tools),
                   tool_choice=named("get_weather"), temperature=0.8, seed=1)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Weather in Bath?"}]
    assert rig.turns[1].prompt is not None
    assert rig.turns[1].prompt.ids == hf_prompt(folder, messages, tools)
    call = calls_of(one)[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])

    rig.turn(1, ["tool"], ['{"temp": 22}'], tools=json.dumps(tools), tool_meta=[meta(tool_call_id=call["id"])],
             max_tokens=4)
    messages += [
        {"role": "assistant", "tool_calls": [{"id": call["id"], "type": "function",
                                              "function": {"name": call["name"],
                                                           "arguments": json.loads(call["arguments"])}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 22}'},
    ]
    assert rig.turns[1].prompt is not None
    assert rig.turns[1].prompt.ids == hf_prompt(folder, messages, tools)


#: Replies in each family's format, as vLLM's parsers document them, and the calls those parsers give.
SCRIPTS = {
    "llama": [
        ('{"name": "get_weather", "parameters": {"city": "Bath", "days": 2}}',
         "", [("get_weather", {"city": "Bath", "days": 2})]),
        ('{"name": "get_weather", "parameters": {"city": "Bath", "days": 2}}; {"name": "roll_dice", "parameters": '
         '{"sides": 6}}', "", [("get_weather", {"city": "Bath", "days": 2}), ("roll_dice", {"sides": 6})]),
        ("The weather is fine.", "The weather is fine.", []),
    ],
    "qwen2": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath", "days": 2}}\n</tool_call>',
         "", [("get_weather", {"city": "Bath", "days": 2})]),
        ('I will check. <tool_call>\n{"name": "roll_dice", "arguments": {"sides": 6}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Ely", "days": 1}}\n</tool_call>',
         "I will check. ", [("roll_dice", {"sides": 6}), ("get_weather", {"city": "Ely", "days": 1})]),
        ("No call here.", "No call here.", []),
    ],
}


@pytest.mark.parametrize("family", list(REAL))
def test_scripted_replies_in_each_familys_format_come_back_as_its_calls(served: dict[str, Path], family: str) -> None:
    rig = Rig(served[family], max_ctx=4096, blocks=1024)
    for k, (reply, content, calls) in enumerate(SCRIPTS[family]):
        sender = rig.turn(k + 1, ["user"], ["Go."], tools=json.dumps([WEATHER, ROLL]), constraint=scripted(reply),
                          max_tokens=200)
        assert text(sender) == content, (family, reply)
        got = [(c["name"], json.loads(c["arguments"])) for c in calls_of(sender)]
        assert got == calls, (family, reply)


def test_auto_with_a_json_response_format_is_that_json_or_a_call() -> None:
    """tool_choice auto with a JSON schema response_format: each reply is either JSON valid for the schema (content,
    no call) or a valid call (no content); both happen over the seeds (the grammar offers the model both)."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    constraint = json.dumps({"type": "json_schema", "schema": schema})
    rig = Rig(DEMO, slots=32, max_ctx=1024, default_max_tokens=200, blocks=2048)
    senders = [rig.submit(k, ["user"], [QUESTIONS[k % 4]], end=True, tools=json.dumps(TOOLS), constraint=constraint,
                          temperature=1.2, seed=k) for k in range(1, 25)]
    rig.run(*senders)
    kinds = set()
    for sender in senders:
        assert sender.refusal is None, sender.refusal
        assert sender.last.finish == "stop"
        calls = calls_of(sender)
        if calls:
            assert text(sender) == ""
            check_calls(calls, {t["function"]["name"] for t in TOOLS})
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(text(sender)), schema)
            kinds.add("json")
    assert kinds == {"call", "json"}


# -- a marker that is a special token ---------------------------------------------------------------------------------

MISTRAL_STYLE = (
    "{%- if tools is not none %}{{- '<|system|>[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]<|end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{- '<|assistant|>[TOOL_CALLS][' }}"
    "{%- for call in message['tool_calls'] %}{{- '{\"name\": ' + (call['function']['name'] | tojson) + "
    "', \"arguments\": ' + (call['function']['arguments'] | tojson) + ', \"id\": ' + (call['id'] | tojson) + '}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']<|end|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|user|>[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]<|end|>' }}"
    "{%- else %}{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def marker_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The demo with its last id made the special token ``[TOOL_CALLS]`` (as in Mistral's vocabularies) and a
    Mistral-style tool_use template: a marker whose token has no bytes, which the reader must still see."""
    folder = tmp_path_factory.mktemp("marker") / "demo"
    shutil.copytree(DEMO, folder)
    raw = json.loads((folder / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    spelled, marker = max(vocab.items(), key=lambda kv: kv[1])
    # The id's BPE token becomes the marker (the model's vocabulary has no room for one more id): its merge goes.
    vocab["[TOOL_CALLS]"] = vocab.pop(spelled)
    raw["model"]["merges"] = [m for m in raw["model"]["merges"]
                              if "".join(m if isinstance(m, list) else m.split(" ")) != spelled]
    raw["added_tokens"].append({"id": marker, "content": "[TOOL_CALLS]", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = MISTRAL_STYLE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, marker


def test_a_special_token_marker_is_read_but_never_shown(marker_checkpoint: tuple[Path, int]) -> None:
    folder, marker = marker_checkpoint
    rig = Rig(folder, max_ctx=1024, default_max_tokens=200)
    assert rig.tokenizer.tool_format is not None
    assert rig.tokenizer.tool_format.name == "mistral"
    assert rig.tokenizer.tool_marker_ids == {marker: "[TOOL_CALLS]"}
    calls_text = json.dumps('[{"name": "roll_dice", "arguments": {"sides": 6}}]')
    grammar = f'start: "Let me see. " <[{marker}]> {calls_text}'
    scripted_marker = json.dumps({"type": "grammar", "syntax": "lark", "grammar": grammar})
    sender = rig.turn(1, ["user"], ["Roll."], tools=json.dumps(TOOLS), constraint=scripted_marker)
    assert marker in rig.turns[1].reply_ids
    assert text(sender) == "Let me see. "
    calls = calls_of(sender)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("roll_dice", {"sides": 6})]
    assert re.fullmatch("[A-Za-z0-9]{9}", calls[0]["id"])  # Mistral's templates pair results by 9-character ids

    # Forced: the grammar writes the marker as its one token, then an array of valid calls.
    forced = rig.turn(2, ["user"], ["Weather?"], tools=json.dumps(TOOLS), tool_choice=named("get_weather"),
                      temperature=0.9, seed=4)
    assert rig.turns[2].reply_ids[0] == marker
    assert text(forced) == ""
    check_calls_mistral = calls_of(forced)
    assert check_calls_mistral
    for call in check_calls_mistral:
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])
        assert re.fullmatch("[A-Za-z0-9]{9}", call["id"])


def test_a_stop_string_never_cuts_a_call() -> None:
    """A stop string matched inside a call would leave broken markup (no call, its text shown): a forced call is not
    searched for stops, and under auto a reply stops being searched once its call markup began; before it, a stop
    cuts the text as ever."""
    rig = Rig(DEMO, max_ctx=1024, default_max_tokens=200)
    forced = rig.turn(1, ["user"], ["Weather?"], tools=json.dumps(TOOLS), tool_choice=named("get_weather"),
                      stop=[",", '"'], temperature=0.9, seed=2)
    assert text(forced) == ""
    check_calls(calls_of(forced), {"get_weather"})
    reply = 'Yes. <tool_call>\n{"name": "roll_dice", "arguments": {"sides": 6, "count": 2}}\n</tool_call>'
    auto = rig.turn(2, ["user"], ["Roll."], tools=json.dumps(TOOLS), constraint=scripted(reply), stop=[","])
    assert text(auto) == "Yes. "
    assert [json.loads(c["arguments"]) for c in calls_of(auto)] == [{"sides": 6, "count": 2}]
    cut = rig.turn(3, ["user"], ["Roll."], tools=json.dumps(TOOLS), constraint=scripted("Yes, " + reply), stop=[","])
    assert text(cut) == "Yes"
    assert cut.last.finish == "stop_string"
    assert calls_of(cut) == []


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


@pytest.mark.parametrize("depth", [40, 450])  # 80 and 900 levels: json.dumps in the test writes up to about 990
def test_tools_and_arguments_nested_too_deeply_are_the_requests_error(depth: int) -> None:
    """Deep nesting that JSON still reads (a schema of 400 levels fits in max_tools_bytes) once escaped parse as a
    RecursionError from the template's walk, which would fail the requests batched with it: it is the request's
    invalid input, naming it, and the engine goes on."""
    rig = Rig(DEMO, max_ctx=1024)
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": _deep(depth)}}])
    arguments = json.dumps(_deep(depth))
    call = meta(tool_calls=[{"id": "c1", "name": "f", "arguments": arguments}])
    for inputs in ({"tools": tools}, {"tools": tools, "tool_choice": "required"}):
        with pytest.raises(ValueError, match="TOOLS"):
            rig.engine.parse(start=True, end=False, roles=["user"], texts=["hi"], **inputs)
    with pytest.raises(ValueError, match=r"TOOL_META\[1\]"):
        rig.engine.parse(start=True, end=False, roles=["user", "assistant", "user"], texts=["a", "", "b"],
                         tool_meta=["", call, ""])
    assert rig.turn(1, ["user"], ["hi"], tools=json.dumps(TOOLS)).reply  # the engine goes on


def test_a_reply_whose_call_nests_too_deeply_is_content() -> None:
    from triton_npu_client.server.chat._tools import TOOL_FORMATS, parse_tool_calls

    fmt = TOOL_FORMATS["hermes"]
    for depth in (70, 5000):
        body = '{"a": ' * depth + "1" + "}" * depth
        text = f'<tool_call>\n{{"name": "f", "arguments": {body}}}\n</tool_call>'
        reply = parse_tool_calls(text, fmt)
        assert reply.tool_calls == ()
        assert reply.content == text

"""Real OpenAI client libraries against the embedded gateway and a real Triton: LangChain (``langchain-openai``),
openai-agents and LiteLLM, each as its users call it, at the versions pinned in constraints.txt.

Replies are greedy, so each one must equal its *stateless twin*: the same history sent whole through the gateway's
Chat Completions with the plain ``openai`` client. Usage is checked against the twin's (the whole prompt) and, for a
turn that continues on the device, against the history the server already held.

Nothing leaves the machine: LangChain's LangSmith tracing and openai-agents' tracing are off, LiteLLM's telemetry is
off and its model-cost map is its bundled copy (``LITELLM_LOCAL_MODEL_COST_MAP``, read at import), and tiktoken (which
LangChain's ``OpenAIEmbeddings`` tokenizes with) reads OpenAI's ``cl100k_base`` from the copy LiteLLM ships
(``TIKTOKEN_CACHE_DIR``) instead of downloading it.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from triton_npu_client._gateway import OpenAIGateway

# Before the libraries are imported: openai-agents reads it when its trace provider is made.
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

import agents
import tiktoken
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, Field

agents.set_tracing_disabled(True)

TOKENS = 8
QUESTIONS = ("Where is the house?", "Who lives there?")
INSTRUCTIONS = "You are terse."
VOCABULARY = 30522  # the minilm encoder's WordPiece vocabulary
# openai-agents fails a run whose response is incomplete (the output cap reached): its turns end at a stop string,
# which the demo model's greedy replies reach within a few tokens (they open '"I am sure,').
AGENT_STOP = [","]
AGENT_TOKENS = 48


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No library phones home: tracing and telemetry off, the local cost map, tiktoken's files from disk; and, to
    hold them to it, any connection or name lookup beyond loopback fails (and fails the test)."""
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_litellm_tokenizers()))
    tried: list[str] = []
    lookup, connect, connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex

    def refuse(host: object) -> None:
        tried.append(repr(host))
        raise OSError(f"the tests reach loopback only, not {host!r}")

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _loopback(host):
            refuse(host)
        return lookup(host, *args, **kwargs)

    def guarded(real: Any) -> Any:
        def call(sock: socket.socket, address: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
                refuse(address[0])
            return real(sock, address)

        return call

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", guarded(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(connect_ex))
    yield
    assert tried == [], f"a library tried to reach beyond loopback: {tried}"


def _loopback(host: object) -> bool:
    if host is None or host in ("localhost", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host)).is_loopback
    except ValueError:
        return False


def _litellm_tokenizers() -> Path:
    """The folder of tiktoken files LiteLLM ships (named as tiktoken's cache names them), found without importing it."""
    spec = importlib.util.find_spec("litellm")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"


# The fixtures client, gateway (an embedded OpenAIGateway) and oa (AsyncOpenAI on it) are conftest.py's.


@pytest.fixture
async def http_client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for a library to use, closed by the test (a library's own would outlive it)."""
    async with httpx.AsyncClient(timeout=120) as http:
        yield http


async def twin(oa: AsyncOpenAI, said: list[tuple[str, str]], *, tokens: int = TOKENS,
               stop: list[str] | None = None) -> tuple[str, int]:  # fmt: skip
    """The stateless twin's text and prompt tokens: the whole history through Chat Completions."""
    done = await oa.chat.completions.create(
        model="chat", messages=[{"role": r, "content": t} for r, t in said],  # type: ignore[misc]
        max_tokens=tokens, temperature=0, stop=stop,
    )  # fmt: skip
    assert done.usage is not None
    text = done.choices[0].message.content or ""
    assert text, "the twin replied nothing: nothing to compare with"
    return text, done.usage.prompt_tokens


async def replays(gateway: OpenAIGateway) -> float:
    """Turns the gateway replayed because their chain was not live on the device."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{gateway.url}/metrics")).text
    line = next((x for x in text.splitlines() if x.startswith('tnc_openai_replays_total{why="not_live"}')), None)
    return 0.0 if line is None else float(line.split()[-1])


# --- LangChain ----------------------------------------------------------------------------------------------------


def chat_openai(gateway: OpenAIGateway, http: httpx.AsyncClient, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(model="chat", base_url=gateway.base_url, api_key="unused", temperature=0,  # type: ignore[arg-type]
                      max_tokens=TOKENS, max_retries=0, http_async_client=http, **options)  # fmt: skip


async def test_langchain_chat_openai_invoke_and_stream_equal_the_twin(
    gateway: OpenAIGateway, oa: AsyncOpenAI, http_client: httpx.AsyncClient
) -> None:
    llm = chat_openai(gateway, http_client, stream_usage=True)
    text, prompt = await twin(oa, [("user", QUESTIONS[0])])
    reply = await llm.ainvoke(QUESTIONS[0])
    assert reply.content == text
    assert reply.usage_metadata is not None
    assert reply.usage_metadata["input_tokens"] == prompt
    assert reply.usage_metadata["output_tokens"] == TOKENS
    assert reply.response_metadata["finish_reason"] == "length"
    chunks = [chunk async for chunk in llm.astream(QUESTIONS[0])]
    assert sum(1 for c in chunks if c.content) > 1  # streamed in pieces, not one block
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk  # type: ignore[assignment]
    assert whole.content == text
    assert whole.usage_metadata is not None  # the usage chunk (stream_options.include_usage)
    assert (whole.usage_metadata["input_tokens"], whole.usage_metadata["output_tokens"]) == (prompt, TOKENS)


async def test_langchain_responses_api_second_turn_continues_on_the_device(
    gateway: OpenAIGateway, oa: AsyncOpenAI, http_client: httpx.AsyncClient
) -> None:
    llm = chat_openai(gateway, http_client, use_responses_api=True, use_previous_response_id=True)
    first = await llm.ainvoke([HumanMessage(QUESTIONS[0])])
    assert isinstance(first, AIMessage)
    assert first.text == (await twin(oa, [("user", QUESTIONS[0])]))[0]
    replayed = await replays(gateway)
    second = await llm.ainvoke([HumanMessage(QUESTIONS[0]), first, HumanMessage(QUESTIONS[1])])
    said = [("user", QUESTIONS[0]), ("assistant", first.text), ("user", QUESTIONS[1])]
    text, prompt = await twin(oa, said)
    assert second.text == text
    # LangChain sent only the new message, naming the first response: the gateway continued its chain live.
    stored = await oa.responses.retrieve(second.response_metadata["id"])
    assert stored.previous_response_id == first.response_metadata["id"]
    assert [i.content[0].text for i in (await oa.responses.input_items.list(stored.id)).data] == [QUESTIONS[1]]  # type: ignore[union-attr]
    assert await replays(gateway) == replayed
    assert first.usage_metadata is not None
    assert second.usage_metadata is not None
    assert second.usage_metadata["input_tokens"] == prompt  # the whole history it was conditioned on
    # What the server held already: the first turn's prompt and reply (all but the reply's last token, which no pass
    # has read yet); so this turn prefilled only its new message.
    held = first.usage_metadata["input_tokens"] + first.usage_metadata["output_tokens"] - 1
    assert second.usage_metadata["input_token_details"]["cache_read"] == held
    assert second.usage_metadata["input_tokens"] - held <= 16
    for message in (first, second):
        await oa.responses.delete(message.response_metadata["id"])


async def test_langchain_embeddings_default_settings_get_a_refusal_that_says_what_to_do(
    gateway: OpenAIGateway, oa: AsyncOpenAI, http_client: httpx.AsyncClient
) -> None:
    """``OpenAIEmbeddings()`` as it comes tokenizes with tiktoken (cl100k_base, OpenAI's vocabulary) and sends the ids:
    they are not the encoder's, and those past its vocabulary are refused with a message that says so and how to send
    the text instead; with that setting the vectors are the gateway's own for the same texts."""
    texts = ["Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition.",
             "The stock market fell."]  # fmt: skip
    ids = [tiktoken.get_encoding("cl100k_base").encode_ordinary(t) for t in texts]
    assert max(ids[0]) >= VOCABULARY  # OpenAI's ids run past the encoder's vocabulary: that is what is refused
    defaults = OpenAIEmbeddings(model="minilm", base_url=gateway.base_url, api_key="unused",  # type: ignore[arg-type]
                                max_retries=0, http_async_client=http_client)  # fmt: skip
    assert defaults.check_embedding_ctx_length is True
    with pytest.raises(openai.BadRequestError) as refused:
        await defaults.aembed_documents(texts)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "input[0]"
    assert f"[0, {VOCABULARY})" in error["message"]
    assert "the encoder's own" in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"]
    as_text = OpenAIEmbeddings(
        model="minilm", base_url=gateway.base_url, api_key="unused",  # type: ignore[arg-type]
        max_retries=0, http_async_client=http_client, check_embedding_ctx_length=False,
    )  # fmt: skip
    got = np.array(await as_text.aembed_documents(texts), dtype=np.float32)
    expected = np.array([d.embedding for d in (await oa.embeddings.create(model="minilm", input=texts)).data],
                        dtype=np.float32)  # fmt: skip
    np.testing.assert_array_equal(got, expected)
    assert got.shape == (2, 384)
    query = np.array(await as_text.aembed_query(texts[1]), dtype=np.float32)
    alone = (await oa.embeddings.create(model="minilm", input=texts[1])).data[0].embedding
    np.testing.assert_array_equal(query, np.array(alone, dtype=np.float32))


# --- openai-agents ------------------------------------------------------------------------------------------------


def agent(model: agents.Model) -> agents.Agent[Any]:
    settings = agents.ModelSettings(temperature=0, max_tokens=AGENT_TOKENS, extra_body={"stop": AGENT_STOP})
    return agents.Agent(name="emma", instructions=INSTRUCTIONS, model=model, model_settings=settings)


async def agent_twin(oa: AsyncOpenAI, said: list[tuple[str, str]]) -> tuple[str, int]:
    return await twin(oa, [("system", INSTRUCTIONS), *said], tokens=AGENT_TOKENS, stop=AGENT_STOP)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agents_runner_plain_agent_equals_the_twin(oa: AsyncOpenAI, api: str) -> None:
    model: agents.Model = (
        agents.OpenAIResponsesModel("chat", oa) if api == "responses" else agents.OpenAIChatCompletionsModel("chat", oa)
    )
    result = await agents.Runner.run(agent(model), QUESTIONS[0])
    text, prompt = await agent_twin(oa, [("user", QUESTIONS[0])])
    assert result.final_output == text
    usage = result.context_wrapper.usage
    assert (usage.requests, usage.input_tokens) == (1, prompt)
    assert 0 < usage.output_tokens < AGENT_TOKENS  # ended at the stop string
    if api == "responses":
        stored = await oa.responses.retrieve(result.last_response_id or "")
        assert stored.output_text == text
        assert stored.instructions == INSTRUCTIONS
        await oa.responses.delete(stored.id)


async def test_agents_sqlite_session_replays_the_gateways_own_items_as_input(oa: AsyncOpenAI, tmp_path: Path) -> None:
    """The session keeps each turn's items as the gateway returned them (an output message with its id, status and
    output_text part with annotations and logprobs) and sends them back as the next turn's input."""
    session = agents.SQLiteSession("emma", str(tmp_path / "session.sqlite3"))
    try:
        emma = agent(agents.OpenAIResponsesModel("chat", oa))
        first = await agents.Runner.run(emma, QUESTIONS[0], session=session)
        second = await agents.Runner.run(emma, QUESTIONS[1], session=session)
        items = await session.get_items()
    finally:
        session.close()
    said = [("user", QUESTIONS[0]), ("assistant", first.final_output)]
    text, prompt = await agent_twin(oa, [*said, ("user", QUESTIONS[1])])
    assert first.final_output == (await agent_twin(oa, said[:1]))[0]
    assert second.final_output == text
    assert second.context_wrapper.usage.input_tokens == prompt  # the replayed items are the whole history
    assert [item.get("role") for item in items] == ["user", "assistant", "user", "assistant"]
    output = items[1]
    assert output["type"] == "message"  # type: ignore[typeddict-item]
    assert output["status"] == "completed"  # type: ignore[typeddict-item]
    assert output["content"] == [{"type": "output_text", "text": first.final_output, "annotations": [],  # type: ignore[typeddict-item]
                                  "logprobs": []}]  # fmt: skip
    for result in (first, second):
        await oa.responses.delete(result.last_response_id or "")


async def test_agents_openai_conversations_session_keeps_the_turns_in_the_gateways_conversation(
    oa: AsyncOpenAI,
) -> None:
    session = agents.OpenAIConversationsSession(openai_client=oa)
    emma = agent(agents.OpenAIResponsesModel("chat", oa))
    first = await agents.Runner.run(emma, QUESTIONS[0], session=session)
    second = await agents.Runner.run(emma, QUESTIONS[1], session=session)
    said = [("user", QUESTIONS[0]), ("assistant", first.final_output)]
    text, prompt = await agent_twin(oa, [*said, ("user", QUESTIONS[1])])
    assert first.final_output == (await agent_twin(oa, said[:1]))[0]
    assert second.final_output == text
    assert second.context_wrapper.usage.input_tokens == prompt
    # The session's items are the gateway's conversation items (POST and GET /v1/conversations/{id}/items).
    listed = (await oa.conversations.items.list(session.session_id, order="asc")).data
    assert [(i.role, i.content[0].text) for i in listed] == [*said, ("user", QUESTIONS[1]),  # type: ignore[union-attr]
                                                             ("assistant", second.final_output)]  # fmt: skip
    assert await session.get_items(limit=2) == [i.model_dump(exclude_unset=True) for i in listed[2:]]
    popped = await session.pop_item()  # DELETE /v1/conversations/{id}/items/{item_id}
    assert popped is not None
    assert popped["id"] == listed[-1].id  # type: ignore[typeddict-item]
    assert [i.id for i in (await oa.conversations.items.list(session.session_id, order="asc")).data] == [
        i.id for i in listed[:-1]
    ]
    conversation = session.session_id
    await session.clear_session()  # DELETE /v1/conversations/{id}
    with pytest.raises(openai.NotFoundError):
        await oa.conversations.retrieve(conversation)
    for result in (first, second):
        await oa.responses.delete(result.last_response_id or "")


# --- LiteLLM ------------------------------------------------------------------------------------------------------


@pytest.fixture
async def litellm() -> AsyncIterator[Any]:
    import litellm as module  # after LITELLM_LOCAL_MODEL_COST_MAP is set (the offline fixture)

    # The warnings LiteLLM silences when it is imported (its stream reader reads every attribute of a delta, which
    # pydantic 2.11 warns about on an instance): pytest restores the filters after each test, so a test that finds
    # LiteLLM imported already (tests/test_openai_tools.py uses it too) sets them again.
    silenced = (".*conflict with protected namespace.*", ".*Accessing the.*attribute on the instance is deprecated.*",
                ".*`ReadOnly` qualifier.*")  # fmt: skip
    for message in silenced:
        warnings.filterwarnings("ignore", message=message)
    module.telemetry = False
    yield module
    await module.close_litellm_async_clients()


async def test_litellm_acompletion_plain_and_streamed_equal_the_twin(
    gateway: OpenAIGateway, oa: AsyncOpenAI, litellm: Any
) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    call: dict[str, Any] = {"model": "openai/chat", "api_base": gateway.base_url, "api_key": "unused",
                            "messages": messages, "temperature": 0, "max_tokens": TOKENS}  # fmt: skip
    text, prompt = await twin(oa, [("user", QUESTIONS[0])])
    done = await litellm.acompletion(**call)
    assert done.choices[0].message.content == text
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt, TOKENS)
    stream = await litellm.acompletion(**call, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(1 for p in pieces if p) > 1
    assert "".join(pieces) == text
    usage = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert usage
    assert (usage[-1].prompt_tokens, usage[-1].completion_tokens) == (prompt, TOKENS)


def test_the_libraries_are_the_pinned_versions() -> None:
    """The tests above were written against these; constraints.txt pins them (and pyproject's test extra names
    them)."""
    from importlib.metadata import version

    pins = dict(
        line.split("==") for line in (Path(__file__).parents[1] / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )  # fmt: skip
    for name in ("langchain-openai", "openai-agents", "litellm"):
        assert version(name) == pins[name], name


# --- structured outputs through the libraries ------------------------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)


async def test_langchain_with_structured_output(gateway: OpenAIGateway) -> None:
    """with_structured_output's json_schema method (a strict schema from a pydantic class) gives a Person. Its
    json_mode (any JSON object) works the same way on the server, but the demo model's free objects never close
    within a cap (tests/test_chat_constraints.py checks them as prefixes); function_calling needs tools: not yet."""
    llm = ChatOpenAI(model="chat", base_url=gateway.base_url, api_key="unused", max_retries=0, temperature=0.8,
                     seed=3, max_completion_tokens=60)  # type: ignore[call-arg]
    person = await llm.with_structured_output(Person, method="json_schema").ainvoke("Who is she?")
    assert isinstance(person, Person)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agents_output_type_gives_a_valid_object(oa: AsyncOpenAI, api: str) -> None:
    model: agents.Model = (
        agents.OpenAIResponsesModel("chat", oa) if api == "responses" else agents.OpenAIChatCompletionsModel("chat", oa)
    )
    settings = agents.ModelSettings(temperature=0.7, max_tokens=80, extra_body={"seed": 5})
    typed = agents.Agent(name="emma", instructions=INSTRUCTIONS, model=model, model_settings=settings,
                         output_type=Person)  # fmt: skip
    result = await agents.Runner.run(typed, "Who is she?")
    assert isinstance(result.final_output, Person)

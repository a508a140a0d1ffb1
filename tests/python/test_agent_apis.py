"""Issue 29's clients against a running `calla serve` on the demo checkpoint (random weights): the
official anthropic SDK (Messages), openai's Responses API, and structured output, which only a
constrained decoder can give on a random model: every reply is parsed and validated."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest

MODEL = "calla-demo"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "admin", "color"],
    "additionalProperties": False,
}


def valid_person(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "admin", "color"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 8
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 120
        and isinstance(value["admin"], bool)
        and value["color"] in ("red", "green", "blue")
    )


def oa(server, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", max_retries=0, timeout=120, **kw)


def an(server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=120, **kw)


WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}

# ------------------------------------------------------------------------------------------------
# Anthropic Messages


def test_anthropic_messages_create(server):
    m = an(server).messages.create(
        model=MODEL,
        max_tokens=12,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello!"}],
        extra_body={"temperature": 0},
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in m.content)
    assert m.usage.input_tokens > 0
    assert 0 < m.usage.output_tokens <= 12


def test_anthropic_stream_matches_create(server):
    client = an(server)
    kwargs = dict(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_thinking_blocks(server):
    m = an(server).messages.create(
        model=MODEL,
        max_tokens=40,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Think."}],
        extra_body={"temperature": 0},
    )
    # the random model may never close its think block: then everything is thinking
    assert m.content and m.content[0].type == "thinking"


def test_anthropic_forced_tool_use_is_valid(server):
    for seed_text in ("Weather?", "Paris", "Tell me"):
        m = an(server).messages.create(
            model=MODEL,
            max_tokens=120,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": seed_text}],
            extra_body={"temperature": 1.0},
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1 and m.stop_reason == "tool_use", m
        assert uses[0].name == "get_weather"
        assert isinstance(uses[0].input["city"], str) and 1 <= uses[0].input["days"] <= 7
        # the result goes back
        r = an(server).messages.create(
            model=MODEL,
            max_tokens=8,
            tools=[WEATHER],
            messages=[
                {"role": "user", "content": seed_text},
                {"role": "assistant", "content": [u.model_dump() for u in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]},
            ],
        )
        assert r.type == "message"


def test_anthropic_count_tokens(server):
    client = an(server)
    messages = [{"role": "user", "content": "Count me."}]
    n = client.messages.count_tokens(model=MODEL, messages=messages)
    m = client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_anthropic_errors(server, keyed_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        an(server).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        an(server).messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        an(keyed_server, api_key="wrong").messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    ok = an(keyed_server, api_key="sk-calla-test").messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    assert ok.type == "message"


# ------------------------------------------------------------------------------------------------
# OpenAI Responses


def test_responses_create_and_retrieve(server):
    client = oa(server)
    r = client.responses.create(model=MODEL, input="Hello!", instructions="Be brief.", max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str)
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    got = client.responses.retrieve(r.id)
    assert got.id == r.id


def test_responses_stream(server):
    client = oa(server)
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=16, temperature=0)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.status == whole.status


def test_responses_function_call_round_trip(server):
    client = oa(server)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"], "strict": True}
    r = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=1.0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert isinstance(args["city"], str) and 1 <= args["days"] <= 7
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert follow.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="x")


def test_responses_text_format_json_schema(server):
    for seed in range(3):
        r = oa(server).responses.create(
            model=MODEL, input=f"Person {seed}", max_output_tokens=120, temperature=1.0,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        )
        assert valid_person(json.loads(r.output_text)), r.output_text


# ------------------------------------------------------------------------------------------------
# Structured output on chat completions


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_is_enforced(server, seed):
    r = oa(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], seed=seed,
        temperature=1.0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert valid_person(json.loads(r.choices[0].message.content)), r.choices[0].message.content


def test_json_object_and_bad_formats(server):
    r = oa(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], temperature=0, max_tokens=60,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError):
        oa(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={"type": "bogus"}
        )


def test_forced_tool_calls_are_declared_and_valid(server):
    tools = [{"type": "function", "function": {"name": "set_person", "parameters": PERSON}},
             {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    for seed in range(3):
        r = oa(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Call."}], tools=tools, seed=seed,
            tool_choice={"type": "function", "function": {"name": "set_person"}}, parallel_tool_calls=False,
            temperature=1.0, max_tokens=150,
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == "set_person"
        assert valid_person(json.loads(calls[0].function.arguments))
    r = oa(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Call."}], tools=tools, tool_choice="required",
        temperature=1.0, max_tokens=150, parallel_tool_calls=False,
    )
    assert [c.function.name in ("set_person", "ping") for c in r.choices[0].message.tool_calls] == [True]


def test_model_retrieve(server):
    assert oa(server).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oa(server).models.retrieve("other")


# ------------------------------------------------------------------------------------------------
# openai-agents with its default model (the Responses API) and a tool


def test_openai_agents_default_model_calls_a_tool(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    calls = []

    # A closed set of cities: free text from a random model would not end before max_tokens.
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model=MODEL,
        tools=[get_weather],
        # required, so the random model calls it; the tool's result is the answer (a random model's own
        # text would run to max_tokens, which the SDK treats as an error)
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=1.0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=2)
    assert calls in (["Paris"], ["Rome"])
    assert result.final_output == "sunny"


def test_anthropic_stream_with_a_forced_tool(server):
    with an(server).messages.stream(
        model=MODEL,
        max_tokens=120,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather?"}],
        extra_body={"temperature": 1.0},
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1
    assert isinstance(uses[0].input["city"], str) and 1 <= uses[0].input["days"] <= 7


def test_responses_stream_with_a_forced_function_call(server):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"], "strict": True}
    with oa(server).responses.stream(
        model=MODEL, input="Weather?", tools=[tool], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=120, temperature=1.0,
    ) as stream:
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert final.status == "completed" and len(calls) == 1
    args = json.loads(calls[0].arguments)
    assert isinstance(args["city"], str) and 1 <= args["days"] <= 7

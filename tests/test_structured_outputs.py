"""Structured outputs and tools on the real service, with the clients that use them: the `openai`
SDK's `parse` (pydantic models, streamed and not), `response_format`, vLLM's guided_* fields,
function calling (tool_choice, streamed tool-call deltas, tool results in the history), and
LangChain's `with_structured_output`, `bind_tools` and `abatch`."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from pydantic import BaseModel

from tests.test_serving import TARGET

NO_CACHE = {"Cache-Control": "no-cache, no-store"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"], "additionalProperties": False},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int


class WeatherArgs(BaseModel):
    model_config = {"extra": "forbid"}
    city: str
    days: int | None = None


def test_parse_with_a_pydantic_model_streamed_and_not(service):
    client = service.openai(api_key="sk-structured")
    messages = [{"role": "user", "content": "Ann is 31 years old. Give her name and age."}]
    done = client.chat.completions.parse(model=TARGET, messages=messages, response_format=Person, max_tokens=48,
                                         temperature=0, extra_headers=NO_CACHE)
    assert isinstance(done.choices[0].message.parsed, Person), done
    assert done.choices[0].finish_reason == "stop" and done.system_fingerprint
    with client.chat.completions.stream(model=TARGET, messages=messages, response_format=Person, max_tokens=48,
                                        temperature=0, extra_headers=NO_CACHE) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == done.choices[0].message.parsed


def test_json_object_and_guided_fields_constrain_the_output(service):
    client = service.openai(api_key="sk-structured")
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    plain = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=32, temperature=0)
    assert plain.choices[0].message.content not in ("yes", "no"), "the guided answer must differ from the free one"
    choice = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"guided_regex": "(Yes|No), [a-z]+\\."})
    assert re.fullmatch("(Yes|No), [a-z]+\\.", regex.choices[0].message.content), regex
    obj = client.chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": "Bob is 40. Reply in JSON with his name and age."}],
        max_tokens=96, temperature=0, response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop", obj
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(((("}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_grammars_and_tools_are_400s_that_name_the_field(service, extra, param):
    body = {"model": TARGET, "messages": ASK_WEATHER, "max_tokens": 5, **extra}
    resp = httpx.post(service.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error", resp.text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_tool_call_has_arguments_valid_for_its_schema(service, tool_choice):
    client = service.openai(api_key="sk-tools")
    resp = client.chat.completions.create(model=TARGET, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=tool_choice,
                                          parallel_tool_calls=False, max_tokens=64, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    WeatherArgs.model_validate_json(call.function.arguments)


def test_streamed_tool_calls_arrive_as_deltas_and_a_tool_result_continues_the_conversation(service):
    client = service.openai(api_key="sk-tools")
    stream = client.chat.completions.create(model=TARGET, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    call = calls[0]
    WeatherArgs.model_validate_json(call["arguments"])
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], max_tokens=24, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_answers_in_text_and_auto_may_call(service):
    client = service.openai(api_key="sk-tools")
    none = client.chat.completions.create(model=TARGET, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                                          max_tokens=16, temperature=0)
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls
    auto = client.chat.completions.create(model=TARGET, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=64,
                                          temperature=0)
    message = auto.choices[0].message
    for call in message.tool_calls or []:
        WeatherArgs.model_validate_json(call.function.arguments)
    assert message.content or message.tool_calls


def test_langchain_structured_output_tools_and_abatch(service):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=TARGET, base_url=service.base_url + "/v1", api_key="sk-langchain",
                                      temperature=0, max_tokens=64)
    person = llm.with_structured_output(Person).invoke("Carl is 25 years old. Give his name and age.")
    assert isinstance(person, Person), person

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    message = llm.bind_tools([multiply], tool_choice="multiply").invoke("What is 6 times 7?")
    (call,) = message.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values()), call
    answers = asyncio.run(llm.abatch(["Hi!", "Name a color.", "Name a fruit.", "Count to three."]))
    assert len(answers) == 4 and all(a.content for a in answers)

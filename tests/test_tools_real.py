"""Tool calls with real clients against ``cpullm serve qwen2.5-coder-0.5b-instruct`` (slow: the
real model): the openai client's full tool loop (call -> tool result -> final answer), streamed
tool-call deltas, LangChain's ``bind_tools`` and ``with_structured_output``, the OpenAI Agents
SDK. Greedy decoding, so each answer is the model's own deterministic choice."""
from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from realmodels import real_model_dir  # noqa: E402
from test_server_support import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "qwen2.5-coder-0.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def _constraints_missing() -> str | None:
    """Why constrained decoding cannot run here (None when it can)."""
    try:
        import llguidance  # noqa: F401
        from cpullm.generate import constraints  # noqa: F401
    except ImportError as exc:
        return f"constrained decoding (cpullm[structured]: llguidance, cpullm.generate.constraints) is not installed: {exc}"
    return None


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(real_model_dir(NAME), "--model-name", NAME, ctx=2048, timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_openai_tool_loop(client):
    """The model calls the declared tool, gets its result back through the chat template, and
    answers in text."""
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18, "sky": "cloudy"})}]
    final = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], temperature=0, max_tokens=64)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content and answer.message.content.strip()


def test_streamed_tool_call_deltas_match_the_answer(client):
    whole = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=64)
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0,
                                                max_tokens=64, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.choices[0].message.tool_calls]


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_langchain_bind_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return "18C"

    llm = lc.ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key="unused", temperature=0,
                        max_tokens=64, max_retries=0, timeout=600).bind_tools([get_weather])
    msg = llm.invoke("What is the weather in Paris? Use the tool.")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = list(llm.stream("What is the weather in Paris? Use the tool."))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_langchain_structured_output(server):
    why = _constraints_missing()
    if why:
        pytest.skip(why)
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    llm = lc.ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key="unused", temperature=0,
                        max_tokens=64, max_retries=0, timeout=600)
    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(City, method=method).invoke("Paris is the capital of France. "
                                                                     "Extract the city.")
        assert isinstance(out, City) and out.name and out.country, (method, out)


def test_openai_agents_sdk_runs_the_tool(server):
    """The Agents SDK's defaults (strict tool schemas, its request fields) are served: the agent
    calls the tool and finishes with a text answer."""
    why = _constraints_missing()
    if why:
        pytest.skip(why)
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        seen.append(city)
        return "18 degrees and cloudy"

    model = agents.OpenAIChatCompletionsModel(
        model=NAME, openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                                     timeout=600))
    agent = agents.Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert seen and seen[0].lower().startswith("paris")
    assert isinstance(result.final_output, str) and result.final_output.strip()

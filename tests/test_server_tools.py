"""The server's request surface for agents, on the tiny chat model: every field of OpenAI's chat
and completions request schemas (read from the installed ``openai`` client's types) is honored,
accepted as a documented label, or refused with a 400 naming it; tools / tool_choice /
reasoning requests are checked; thinking switches reach the template only where it has one."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import openai.types.chat.completion_create_params as chat_params  # noqa: E402
import openai.types.completion_create_params as completion_params  # noqa: E402
from test_server_support import shared_server  # noqa: E402

from cpullm.serve import openai as api  # noqa: E402

HI = [{"role": "user", "content": "Hello there"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
# a value for each field that is not its default (so a server that dropped it would be caught)
SAMPLES = {
    "audio": {"voice": "alloy", "format": "mp3"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "logit_bias": {"5": 1.0}, "logprobs": True,
    "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"run": "test"}, "modalities": ["text", "audio"],
    "moderation": {}, "n": 2, "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5, "prompt_cache_key": "k1", "prompt_cache_options": {}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "u-1",
    "seed": 7, "service_tier": "flex", "stop": ["zz"], "store": True, "stream_options": {"include_usage": True},
    "temperature": 0.5, "tool_choice": "none", "tools": [WEATHER], "top_logprobs": 2, "top_p": 0.9,
    "user": "someone", "verbosity": "low", "web_search_options": {}, "best_of": 2, "echo": True,
    "suffix": "end", "prompt": "Hello",
}


def _fields(module) -> list[str]:
    return sorted(module.CompletionCreateParamsBase.__annotations__)


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.mark.parametrize("kind,module,path", [("chat", chat_params, "/v1/chat/completions"),
                                              ("completion", completion_params, "/v1/completions")])
def test_every_openai_request_field_is_honored_labelled_or_refused(server, kind, module, path):
    """Each field of the openai client's request type, sent alone with a non-default value: a
    label gets 200; a field the server honors gets 200 or (a value it cannot serve) a 400 naming
    it; a refused one a 400 naming it and what to send instead. None is dropped unnoticed."""
    fields = _fields(module)
    assert "messages" in fields if kind == "chat" else "prompt" in fields
    honored = api.CHAT_FIELDS if kind == "chat" else api.COMPLETION_FIELDS
    base = {"messages": HI} if kind == "chat" else {"prompt": "Hello"}
    base.update(max_tokens=3, temperature=0)
    unclassified = [f for f in fields if f not in honored and f not in api.LABEL_FIELDS
                    and f not in api.REFUSED_FIELDS]
    assert not unclassified, f"OpenAI request fields the server does not classify: {unclassified}"
    for field in fields:
        if field in ("model", "messages", "prompt"):
            continue
        assert field in SAMPLES, f"add a sample value for {field}"
        body = dict(base, **{field: SAMPLES[field]})
        r = _post(server, path, body)
        if field in api.LABEL_FIELDS:
            assert r.status_code == 200, (field, r.text)
        elif field in api.REFUSED_FIELDS:
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
            assert "instead" in r.json()["error"]["message"] or "omit" in r.json()["error"]["message"], r.text
        else:
            assert r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["param"] == field), \
                (field, r.status_code, r.text)
        # null means "not sent": always accepted
        assert _post(server, path, dict(base, **{field: None})).status_code == 200, field


def test_unknown_fields_are_refused(server):
    r = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "guided_tempurature": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "guided_tempurature" and err["code"] == "unknown_parameter"
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "chat_template_kwargs": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


BAD_TOOLS = [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "declared twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "JSON schema"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "does not think"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "no thinking switch"),
    # the tiny model's ChatML template has no tool format: a call cannot be forced
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", None),
]


@pytest.mark.parametrize("extra,param,part", BAD_TOOLS, ids=[str(i) for i in range(len(BAD_TOOLS))])
def test_bad_tool_and_reasoning_requests(server, extra, param, part):
    r = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if part:
        assert part in err["message"], err


def test_tool_history_renders_and_auto_answers(server):
    """A full tool turn (assistant tool_calls, a tool result) goes through the template; with
    tool_choice auto / none the answer is an ordinary message. (Content "": this ChatML template
    adds the content to a string, so a None there fails its render, a 400 chat_template_error.)"""
    msgs = HI + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    for choice in ("auto", "none"):
        r = _post(server, "/v1/chat/completions", {"messages": msgs, "tools": [WEATHER], "tool_choice": choice,
                                                  "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["role"] == "assistant" and isinstance(msg["content"], str)


QWEN3_LIKE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
              "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}")


def _fake_model(tmp_path, family_name, template):
    from cpullm.loading import plugins
    fam = next(f for f in plugins.discover().families if f.name == family_name)
    (tmp_path / "chat_template.jinja").write_text(template)
    return SimpleNamespace(family=fam, model_dir=tmp_path, tokenizer=SimpleNamespace(config={}))


def test_thinking_switches_reach_a_template_that_has_them(tmp_path):
    model = _fake_model(tmp_path, "qwen3", QWEN3_LIKE)
    plan = api.plan_chat(model, {"reasoning_effort": "none"}, HI, None, "auto", True, {})
    assert plan.template_kwargs == {"enable_thinking": False} and plan.reasoning is not None
    plan = api.plan_chat(model, {}, HI, None, "auto", True, {"enable_thinking": True})
    assert plan.template_kwargs == {"enable_thinking": True}
    with pytest.raises(api.ApiError, match="'none', 'medium'"):
        api.plan_chat(model, {"reasoning_effort": "high"}, HI, None, "auto", True, {})
    with pytest.raises(api.ApiError, match="true or false"):
        api.plan_chat(model, {}, HI, None, "auto", True, {"enable_thinking": "no"})
    # the answer of a prompt that opened the thinking starts inside it
    answer, constraint = plan.answer(model, "<|im_start|>assistant\n<think>\n")
    assert answer.thinking and constraint is None
    events = answer.parser().push("a thought</think>\n\nParis.") + answer.parser().finish()
    assert ("reasoning", "a thought") in events and ("content", "Paris.") in events
    # the same family with a template that does not think: refused
    (tmp_path / "plain").mkdir()
    plain = _fake_model(tmp_path / "plain", "qwen3", "{{ messages[0].content }}")
    with pytest.raises(api.ApiError, match="does not think"):
        api.plan_chat(plain, {"reasoning_effort": "none"}, HI, None, "auto", True, {})


def test_a_family_without_native_format_rewrites_the_conversation(tmp_path):
    model = _fake_model(tmp_path, "gemma3_text", "{{ messages | tojson }}")
    msgs = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    plan = api.plan_chat(model, {}, msgs, [WEATHER], "auto", True, {})
    assert plan.template_tools is None and plan.messages[0]["role"] == "system"
    assert [m["role"] for m in plan.messages] == ["system", "user", "assistant", "user"]
    assert json.loads(plan.messages[2]["content"][len("<tool_call>"):-len("</tool_call>")])["name"] == "get_weather"


THINKING_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                     "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                     "{%- if enable_thinking is defined and enable_thinking is false %}"
                     "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A tiny random Qwen3 whose template opens the thinking in the prompt (as Qwen3.5's does):
    its answer is thinking until it writes </think>, which random weights never do."""
    from cpullm_qwen.tiny_configs import QWEN3
    from test_server_support import ServerProcess

    from cpullm.testing import make_random_checkpoint

    out = make_random_checkpoint(dict(QWEN3, eos_token_id=10**6), tmp_path_factory.mktemp("qwen3think") / "m")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": THINKING_TEMPLATE}))
    s = ServerProcess(out, "--model-name", "thinker")
    yield s
    s.stop()


def test_reasoning_content_and_deltas(thinking_server):
    """Thinking goes to reasoning_content (and reasoning deltas when streamed), not content;
    enable_thinking false reaches the template and the answer is content again."""
    url = thinking_server.url + "/v1/chat/completions"
    body = {"messages": HI, "max_tokens": 8, "temperature": 0}
    on = httpx.post(url, json=body, timeout=120).json()
    msg = on["choices"][0]["message"]
    assert msg["content"] == "" and msg["reasoning_content"]
    reasoning, content = "", ""
    with httpx.stream("POST", url, json=dict(body, stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content", "")
                content += delta.get("content", "")
    assert content == "" and reasoning.strip() == msg["reasoning_content"]
    off = httpx.post(url, json=dict(body, chat_template_kwargs={"enable_thinking": False}), timeout=120).json()
    off_msg = off["choices"][0]["message"]
    assert "reasoning_content" not in off_msg and isinstance(off_msg["content"], str)
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]     # the template closed it
    r = httpx.post(url, json=dict(body, reasoning_effort="none"), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == off_msg
    r = httpx.post(url, json=dict(body, reasoning_effort="high"), timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


HERMES_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- t | tojson }}"
                   "{%- endfor %}{{- ' Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
                   "<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + "
                   "(m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
                   "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["unit", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    """A tiny random Qwen2 with a template that writes calls in <tool_call> tags."""
    pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")
    from cpullm_qwen.tiny_configs import QWEN2
    from test_server_support import ServerProcess

    from cpullm.testing import make_random_checkpoint

    out = make_random_checkpoint(dict(QWEN2), tmp_path_factory.mktemp("qwen2tools") / "m")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES_TEMPLATE}))
    s = ServerProcess(out, "--model-name", "caller", ctx=1024)
    yield s
    s.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "forecast"}}])
def test_a_forced_call_from_random_weights_is_valid(hermes_server, choice):
    """With tool_choice required or named, even a model of random weights answers with a call
    of a declared tool whose arguments satisfy its schema (the constraint), streamed or not."""
    jsonschema = pytest.importorskip("jsonschema")
    url = hermes_server.url + "/v1/chat/completions"
    # required: only the tool whose schema a random model finishes quickly (a free string would
    # take it hundreds of tokens); named: forecast picked among two
    tools = [FORECAST] if choice == "required" else [WEATHER, FORECAST]
    body = {"messages": HI, "tools": tools, "tool_choice": choice, "max_tokens": 200, "temperature": 0.8,
            "seed": 3}
    r = httpx.post(url, json=body, timeout=300).json()
    assert "choices" in r, r
    choice0 = r["choices"][0]
    assert choice0["finish_reason"] == "tool_calls", r
    got = choice0["message"]["tool_calls"]
    assert got                                 # parallel calls allowed: each one valid
    for call in got:
        assert call["function"]["name"] == "forecast"
        jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST["function"]["parameters"])
    calls = []
    with httpx.stream("POST", url, json=dict(body, stream=True), timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                calls += json.loads(line[6:])["choices"][0]["delta"].get("tool_calls", [])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("forecast", json.loads(c["function"]["arguments"])) for c in got]


def test_python_chat_api(tmp_path):
    """model.chat: the assistant message with tool_calls (a forced call is valid), streamed
    pieces, and tokenizer.apply_chat_template over a tool turn."""
    pytest.importorskip("llguidance", reason="llguidance (cpullm[structured]) is not installed")
    jsonschema = pytest.importorskip("jsonschema")
    import cpullm
    from cpullm_qwen.tiny_configs import QWEN2

    from cpullm.testing import make_random_checkpoint

    out = make_random_checkpoint(dict(QWEN2), tmp_path / "m")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES_TEMPLATE}))
    model = cpullm.load(out, threads=1, n_ctx=1024)
    msg = model.chat(HI, tools=[FORECAST], tool_choice="required", max_new_tokens=200, temperature=0.8, seed=3,
                     parallel_tool_calls=False)
    # content is not checked: once the call is complete the constraint offers this byte-level test
    # vocabulary's token 0, not its end token, so a random model may write a character after it
    assert msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST["function"]["parameters"])
    pieces = list(model.chat(HI, tools=[FORECAST], tool_choice="required", max_new_tokens=200, temperature=0.8,
                             seed=3, stream=True, parallel_tool_calls=False))
    assert [p["tool_call"]["function"]["arguments"] for p in pieces if "tool_call" in p] == \
        [call["function"]["arguments"]]
    plain = model.chat(HI, max_new_tokens=4)
    assert set(plain) == {"role", "content"} and isinstance(plain["content"], str)
    turn = HI + [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    text = model.tokenizer.apply_chat_template(turn, tools=[FORECAST])
    assert text.endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n") and '"forecast"' in text
    assert model.tokenizer.apply_chat_template(turn, tools=[FORECAST], tokenize=True) == \
        model.tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(api.ApiError, match="not in tools"):
        model.chat(HI, tools=[FORECAST], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_response_format_beside_tools(hermes_server):
    """Under tool_choice auto, response_format and tools make one grammar: the answer is a call
    or JSON of the format's schema; a regex beside tools cannot be combined: a 400 naming tools."""
    jsonschema = pytest.importorskip("jsonschema")
    url = hermes_server.url + "/v1/chat/completions"
    answer_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}
    for seed in (1, 2, 3):
        r = httpx.post(url, json={"messages": HI, "tools": [FORECAST], "max_tokens": 120, "temperature": 1.0,
                                  "seed": seed, "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "reply", "schema": answer_schema}}}, timeout=300).json()
        msg = r["choices"][0]["message"]
        if msg.get("tool_calls"):
            jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]),
                                FORECAST["function"]["parameters"])
        else:
            jsonschema.validate(json.loads(msg["content"]), answer_schema)
    r = httpx.post(url, json={"messages": HI, "tools": [FORECAST], "max_tokens": 4,
                              "guided_regex": "[a-z]+"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_n_choices_each_carry_their_calls(hermes_server):
    """n > 1 with a forced call: every choice is a valid call of its own (own parser, own copy of
    the constraint)."""
    jsonschema = pytest.importorskip("jsonschema")
    r = httpx.post(hermes_server.url + "/v1/chat/completions", timeout=300, json={
        "messages": HI, "tools": [FORECAST], "tool_choice": "required", "parallel_tool_calls": False,
        "n": 2, "max_tokens": 120, "temperature": 1.0, "seed": 5}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1], r
    for c in r["choices"]:
        assert c["finish_reason"] == "tool_calls"
        (call,) = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST["function"]["parameters"])

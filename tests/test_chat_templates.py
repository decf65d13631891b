"""Chat templates: where they are found, real templates' shapes, the sandbox, conversations."""
from __future__ import annotations

import datetime
import json
import types

import pytest

from cpullm.generate.chat import (Conversation, check_messages, chat_prompt_ids, find_template, render_chat,
                         render_template, require_template)
from cpullm.errors import ChatTemplateError, ContextOverflowError

# ---- real templates, typed in from the checkpoints' tokenizer_config.json ---------------------------
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA32 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
          "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
          "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
          "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
          "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

QWEN3_TAIL = """{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

USER_HI = [{"role": "user", "content": "Hi"}]


def test_qwen25_default_system_prompt_and_turns():
    out = render_template(QWEN25, USER_HI + [{"role": "assistant", "content": "Hello!"},
                                             {"role": "user", "content": "2+2?"}])
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                   "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                   "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    own = render_template(QWEN25, [{"role": "system", "content": "Be brief."}] + USER_HI)
    assert own == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert not render_template(QWEN25, USER_HI, add_generation_prompt=False).endswith("assistant\n")


def test_qwen25_tools_are_passed_through_as_json():
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now>",
                                             "parameters": {"type": "object", "properties": {}}}}
    out = render_template(QWEN25, USER_HI, tools=[tool])
    assert "# Tools" in out
    assert json.dumps(tool, ensure_ascii=False) in out      # tojson does not HTML-escape '<'
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}]
    out = render_template(QWEN25, USER_HI + calls, tools=[tool])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert "<tool_response>\nsunny\n</tool_response>" in out


def test_llama32_date_header_from_strftime_now():
    before = datetime.datetime.now().strftime("%d %b %Y")
    out = render_template(LLAMA32, [{"role": "system", "content": "You are terse. "}] + USER_HI,
                          bos_token="<|begin_of_text|>")
    after = datetime.datetime.now().strftime("%d %b %Y")
    expected = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                "Cutting Knowledge Date: December 2023\nToday Date: {}\n\nYou are terse.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert out in (expected.format(before), expected.format(after))
    fixed = render_template(LLAMA32, USER_HI, bos_token="<|begin_of_text|>", date_string="26 Jul 2024")
    assert "Today Date: 26 Jul 2024\n\n<|eot_id|>" in fixed


def test_gemma2_rejects_a_system_message_with_a_clear_error():
    assert render_template(GEMMA2, USER_HI, bos_token="<bos>") == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="rejected the conversation: System role not supported"):
        render_template(GEMMA2, [{"role": "system", "content": "x"}] + USER_HI, bos_token="<bos>")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_template(GEMMA2, USER_HI + USER_HI, bos_token="<bos>")


def test_gemma3_folds_the_system_message_into_the_first_turn():
    out = render_template(GEMMA3, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi "}]},
                                   {"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "Bye"}], bos_token="<bos>")
    assert out == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                   "Hello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_extra_template_variables_pass_through():
    assert render_template(QWEN3_TAIL, USER_HI, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_template(QWEN3_TAIL, USER_HI).endswith("<|im_start|>assistant\n")


def test_generation_tag_and_loop_controls():
    tpl = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
           "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert render_template(tpl, [{"role": "system", "content": "s"}] + USER_HI) == "[Hi]"


# ---- finding the template ----------------------------------------------------------------------------
def test_find_template_sources(tmp_path):
    assert find_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A"}))
    assert find_template(tmp_path) == "A"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"},
        {"name": "rag", "template": "R"}]}))
    assert find_template(tmp_path) == "D"
    assert find_template(tmp_path, tools=[{}]) == "T"
    assert find_template(tmp_path, name="rag") == "R"
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'.*default, tool_use, rag"):
        find_template(tmp_path, name="nope")
    (tmp_path / "chat_template.jinja").write_text("J")        # transformers 5's sidecar wins
    assert find_template(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert find_template(tmp_path) == "P"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert find_template(tmp_path) == "P"


def test_missing_template_error_names_the_fix(tmp_path):
    model = types.SimpleNamespace(model_dir=tmp_path, tokenizer=types.SimpleNamespace(config={}))
    with pytest.raises(ChatTemplateError, match="has no chat template.*base model.*without --chat"):
        require_template(model)


def test_invalid_jinja_is_a_template_error():
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        render_template("{% for %}", USER_HI)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_template("{{ messages[0].content + 1 }}", USER_HI)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_template("{{ 1 / 0 }}", USER_HI)


# ---- the sandbox ---------------------------------------------------------------------------------------
ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ (1).__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].listdir('/') }}",
    "{{ self._TemplateReference__context }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ raise_exception.__code__.co_consts }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ strftime_now.func_globals }}",
    "{{ messages.__class__ }}",
    "{{ messages[0].__class__.__init__ }}",
    "{{ '{0.__class__.__mro__}'.format(1) }}",
    "{{ '%s'|format(messages.__class__) }}",
    "{% set x = messages.append(1) %}{{ x }}",
    "{% set d = messages[0] %}{{ d.update({'role': 'x'}) }}",
    "{{ messages.pop() }}",
    "{{ range.__self__ }}",
    "{{ (messages|attr('__class__')) }}",
    "{{ namespace|attr('__init__')|attr('__globals__') }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_blocks_escapes(template):
    messages = [{"role": "user", "content": "Hi"}]
    try:
        out = render_template(template, messages)
    except ChatTemplateError as exc:
        assert "unsafe" in str(exc) or "failed to render" in str(exc)
    else:
        assert out == "", out          # an attribute that does not exist is just undefined
    assert messages == [{"role": "user", "content": "Hi"}]     # nothing was mutated


def test_sandbox_reports_reaching_for_internals():
    with pytest.raises(ChatTemplateError, match="unsafe operation.*'__class__'"):
        render_template("{{ ''.__class__ }}", USER_HI)


def test_sandbox_has_no_file_system(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    for tpl in (f"{{% include '{secret}' %}}", f"{{% import '{secret}' as s %}}",
                f"{{% extends '{secret}' %}}", f"{{% from '{secret}' import x %}}"):
        with pytest.raises(ChatTemplateError) as info:
            render_template(tpl, USER_HI)
        assert "TOP-SECRET" not in str(info.value)


@pytest.mark.parametrize("template", [
    "{{ 'a' * 10**9 }}", "{{ [1] * 10**8 }}", "{{ 10 ** (10 ** 10) }}", "{{ range(10**9)|list }}",
    "{{ '%0999999999d'|format(1) }}", "{{ '%0999999999d' % 1 }}", "{{ '%.999999999f' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}", "{{ '{0:>{1}}'.format(1, 999999999) }}",
    "{{ '{0:>{w}}'.format_map({'w': 999999999}) }}",
    "{{ 'ab'|center(999999999) }}", "{{ 'x'.ljust(999999999) }}", "{{ 'x'|indent(999999999) }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
])
def test_sandbox_bounds_memory_bombs(template):
    with pytest.raises(ChatTemplateError):
        render_template(template, USER_HI)


# ---- messages and conversations --------------------------------------------------------------------------
def test_bounds_leave_ordinary_templates_alone():
    assert render_template("{{ '%05d|%s' % (42, 'a') }} {{ '%d'|format(12345678) }} {{ 12345678|string }}"
                           "{{ '{:>3}'.format(1) }} {{ 'ab'|center(6) }}{{ 'x' * 3 }}{{ 2 ** 10 }}", []) == \
        "00042|a 12345678 12345678  1   ab  xxx1024"


def test_check_messages():
    out = check_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}])
    assert out == [{"role": "user", "content": "ab"}]
    assert check_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    for bad, msg in [([], "non-empty list"), ("hi", "non-empty list"), ([1], r"messages\[0\] must be an object"),
                     ([{"role": "wizard", "content": "x"}], r"role must be one of"),
                     ([{"role": "user"}], "content is missing"),
                     ([{"role": "user", "content": 3}], "must be a string"),
                     ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                      "'image_url' part; only text")]:
        with pytest.raises(ChatTemplateError, match=msg):
            check_messages(bad)


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory):
    """A model object with a real byte-level tokenizer and ChatML template (no weights needed)."""
    from test_server_support import CHATML
    from cpullm.testing import _write_byte_tokenizer
    from cpullm.loading.tokenize import Tokenizer

    d = tmp_path_factory.mktemp("fake_model")
    _write_byte_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return types.SimpleNamespace(model_dir=d, tokenizer=Tokenizer(d), n_ctx=600)


def test_chat_prompt_ids_render_without_adding_special_tokens(fake_model):
    ids = chat_prompt_ids(fake_model, USER_HI)
    text = render_chat(fake_model, USER_HI)
    assert fake_model.tokenizer.decode(ids) == text
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_conversation_drops_oldest_turns_to_fit(fake_model):
    conv = Conversation(fake_model, system="S")
    ids, dropped = conv.prompt("first", reserve=50)
    assert dropped == 0
    for i in range(3):
        conv.add(f"question {i}", "x" * 60)
    ids, dropped = conv.prompt("next", reserve=50)
    assert dropped == 0 and len(ids) + 50 <= fake_model.n_ctx
    conv.add("question 3", "y" * 100)
    ids, dropped = conv.prompt("last", reserve=50)       # 4 turns no longer fit with room to answer
    assert dropped >= 1 and len(ids) + 50 <= fake_model.n_ctx
    assert conv.turns[-1] == ("question 3", "y" * 100)
    assert conv.turns[0][0] == f"question {dropped}"
    assert conv.messages()[0] == {"role": "system", "content": "S"}   # the system message stays
    with pytest.raises(ContextOverflowError, match="leaving no room for an answer.*raise --ctx"):
        conv.prompt("z" * 500, reserve=50)
    assert conv.turns == []                                            # all dropped, none fit
    conv.add("a", "b")
    conv.reset()
    assert conv.turns == [] and conv.system == "S"


# ---- parity with transformers' own rendering --------------------------------------------------------
@pytest.mark.parametrize("name,template,messages,kwargs", [
    ("qwen2.5", QWEN25, USER_HI + [{"role": "assistant", "content": "Yo"}, {"role": "user", "content": "?"}], {}),
    ("qwen2.5-tools", QWEN25, USER_HI, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("llama3.2", LLAMA32, [{"role": "system", "content": "Be brief."}] + USER_HI, {"date_string": "01 Jan 2025"}),
    ("gemma2", GEMMA2, USER_HI + [{"role": "assistant", "content": " Yo "}, {"role": "user", "content": "?"}], {}),
    ("gemma3", GEMMA3, [{"role": "system", "content": "S"}] + USER_HI, {}),
    ("qwen3-no-thinking", QWEN3_TAIL, USER_HI, {"enable_thinking": False}),
])
@pytest.mark.reference
def test_rendering_matches_transformers(name, template, messages, kwargs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from cpullm.testing import _write_byte_tokenizer

    _write_byte_tokenizer(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tmp_path / "tokenizer.json")),
                                              bos_token="<bos>", eos_token="<eos>")
    hf.chat_template = template
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    extra = {k: v for k, v in kwargs.items() if k != "tools"}
    assert render_template(template, messages, bos_token="<bos>", eos_token="<eos>",
                           tools=kwargs.get("tools"), **extra) == want

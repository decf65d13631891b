"""Tool calls and reasoning without a model: each plugin's format (parsing, streamed piece by
piece, malformed calls), the core's fallbacks, reasoning, the call grammars (checked by
llguidance when it is installed), the conversation rewrite for templates without tools, and the
FamilySpec / format selection contract."""
from __future__ import annotations

import json

import pytest

from cpullm.loading import plugins
from cpullm.loading.family import FamilySpec
from cpullm.toolcalls import (Answer, AnswerParser, ReasoningFormat, ToolCall, call_grammar, collect,
                              messages_for_template, opens_thinking, select, with_thinking)
from cpullm_gemma.chat_formats import TOOL_CALL_JSON
from cpullm_llama.chat_formats import LLAMA3_JSON
from cpullm_qwen.chat_formats import HERMES, THINK, XML

TOOLS = {"get_weather": {"type": "object", "required": ["city"],
                         "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "search": {"type": "object", "properties": {"q": {"type": "string"}}}}
PARIS = ToolCall("get_weather", {"city": "Paris"})


def parse(fmt, text, reasoning=None, thinking=False, step=None):
    """The message of ``text`` read whole, and read in pieces of ``step`` characters (1..7):
    both must agree."""
    whole = collect(AnswerParser(fmt, TOOLS, reasoning, thinking).push(text))
    p = AnswerParser(fmt, TOOLS, reasoning, thinking)
    answers = []
    for size in ([step] if step else range(1, 8)):
        p = AnswerParser(fmt, TOOLS, reasoning, thinking)
        a = Answer()
        for i in range(0, len(text), size):
            collect(p.push(text[i:i + size]), a)
        collect(p.finish(), a)
        answers.append(a)
    p2 = AnswerParser(fmt, TOOLS, reasoning, thinking)
    whole = collect(p2.push(text))
    collect(p2.finish(), whole)
    for a in answers:
        assert (a.content, a.reasoning, a.tool_calls) == (whole.content, whole.reasoning, whole.tool_calls)
    return whole


@pytest.mark.parametrize("fmt,text", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (XML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (TOOL_CALL_JSON, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
])
def test_each_format_parses_its_call_in_any_pieces(fmt, text):
    a = parse(fmt, text)
    assert a.tool_calls == [PARIS]
    assert a.content in ("", "Sure.\n")
    msg = a.message()
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert msg["tool_calls"][0]["type"] == "function" and msg["tool_calls"][0]["id"].startswith("call_")


def test_parallel_calls_and_typed_parameters():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=q>\n42\n</parameter>\n"
            "</function>\n</tool_call>")
    a = parse(XML, text)
    assert a.tool_calls == [ToolCall("get_weather", {"city": "New York", "days": 3}), ToolCall("search", {"q": "42"})]
    assert a.message()["content"] is None
    two = '<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n' * 2
    assert len(parse(HERMES, two).tool_calls) == 2


def test_one_call_when_parallel_calls_are_off():
    two = '<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n' * 2
    p = AnswerParser(HERMES, TOOLS, max_calls=1)
    a = collect(p.push(two))
    collect(p.finish(), a)
    assert a.tool_calls == [ToolCall("search", {"q": "a"})]
    assert a.content == '<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'


@pytest.mark.parametrize("fmt,text", [
    (HERMES, '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>'),   # undeclared
    (HERMES, "<tool_call>\nget_weather(Paris)\n</tool_call>"),                                 # not JSON
    (HERMES, '<tool_call>\n{"name": "get_weather", "argum'),                                  # cut off
    (XML, "<tool_call>\n<function=nope>\n</function>\n</tool_call>"),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": 5}'),
    (LLAMA3_JSON, "{not json} at all"),
])
def test_a_malformed_call_comes_back_as_text(fmt, text, caplog):
    with caplog.at_level("WARNING", logger="cpullm.toolcalls"):
        a = parse(fmt, text, step=3)
    assert a.tool_calls == [] and a.content == text
    assert "returned as text" in caplog.text or fmt is LLAMA3_JSON


def test_text_that_only_mentions_a_trigger_is_content():
    assert parse(LLAMA3_JSON, 'Use {"name": "get_weather"} like this').content.startswith("Use {")
    assert parse(None, "```python\nprint(1)\n```\ndone").content == "```python\nprint(1)\n```\ndone"
    assert parse(None, '{"a": 1}').content == '{"a": 1}'


def test_fallback_fenced_and_bare_json_calls():
    """Without the template's format (or beside it): a fenced JSON block or a bare JSON object
    that is the whole answer and names a declared tool is a call (small coder models write these)."""
    fenced = 'Calling it:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    a = parse(None, fenced)
    assert a.tool_calls == [PARIS] and a.content.strip() == "Calling it:"
    assert parse(HERMES, fenced).tool_calls == [PARIS]
    assert parse(HERMES, '{"name": "get_weather", "arguments": {"city": "Paris"}}').tool_calls == [PARIS]
    # not a call: more text after the object, or an undeclared name
    assert parse(HERMES, '{"name": "get_weather", "arguments": {}} then').tool_calls == []
    assert parse(None, '```json\n{"name": "other", "arguments": {}}\n```').tool_calls == []


def test_plain_text_is_untouched():
    text = "  leading spaces and <think> are kept\n"
    p = AnswerParser()
    a = collect(p.push(text))
    collect(p.finish(), a)
    assert a.content == text and not a.tool_calls


def test_reasoning_is_split_from_the_answer():
    a = parse(None, "<think>\nLet me see.\n</think>\n\nParis.", reasoning=THINK)
    assert (a.reasoning.strip(), a.content) == ("Let me see.", "Paris.")
    assert a.message()["reasoning_content"] == "Let me see."
    # the prompt opened the thinking: the answer starts inside it
    a = parse(HERMES, 'hmm\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      "</tool_call>", reasoning=THINK, thinking=True)
    assert a.reasoning.strip() == "hmm" and a.tool_calls == [PARIS]
    # cut off while thinking: what came is reasoning, no content
    a = parse(None, "still thinking", reasoning=THINK, thinking=True)
    assert a.reasoning == "still thinking" and a.content == ""
    assert opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n", None)


def test_formats_are_chosen_by_the_template():
    hermes_tpl = "... <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    xml_tpl = "<tool_call>\n<function=' + tool_call.name + '>\n<parameter=' + args_name"
    llama_tpl = 'Respond in the format {"name": function name, "parameters": ...} {%- if "tool_calls" in message %}'
    assert select((XML, HERMES), hermes_tpl) is HERMES
    assert select((XML, HERMES), xml_tpl) is XML
    assert select((LLAMA3_JSON,), llama_tpl) is LLAMA3_JSON
    assert select((LLAMA3_JSON,), "{{ message['content'] }}") is None     # plain ChatML: none
    assert select((THINK,), "{{ '<think>' }}") is THINK and select((THINK,), "no thinking") is None
    assert select((HERMES,), None) is None
    boom = ReasoningFormat(name="t.boom", detect=lambda t: 1 / 0)
    assert select((boom, THINK), "<think>") is THINK                     # a plugin bug: no match


def test_installed_families_declare_their_formats():
    fams = {f.name: f for f in plugins.discover().families}
    assert fams["qwen2"].tool_formats == (HERMES,) and fams["qwen2"].reasoning_formats == ()
    assert fams["qwen3"].reasoning_formats == (THINK,)
    assert fams["qwen3_5"].tool_formats[0] is XML
    assert fams["llama"].tool_formats == (LLAMA3_JSON,)
    assert all(fams[n].tool_formats == (TOOL_CALL_JSON,) for n in ("gemma", "gemma2", "gemma3", "gemma3_text"))


def test_a_wrong_format_entry_fails_the_family():
    with pytest.raises(TypeError, match="ToolFormat"):
        FamilySpec(name="x", model_types=("x",), args_class=object, weight_map=None, build_graph=None,
                   tool_formats=("<tool_call>",))


def test_gemma_conversation_is_rewritten_for_its_template():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS["get_weather"]}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18C"}]
    out = messages_for_template(msgs, tools, TOOL_CALL_JSON)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert out[3]["content"] == '<tool_response name="get_weather">18C</tool_response>'
    assert messages_for_template(msgs, tools, HERMES) is msgs                # the template does it


llguidance = None
try:
    import llguidance  # noqa: F811
except ImportError:
    pass


@pytest.mark.skipif(llguidance is None, reason="llguidance (the optional cpullm[structured] extra) is not installed")
@pytest.mark.parametrize("fmt", [HERMES, XML, LLAMA3_JSON, TOOL_CALL_JSON], ids=lambda f: f.name)
def test_call_grammars_compile_and_accept_the_calls(fmt):
    """Every grammar compiles in llguidance, and the required grammar accepts the calls the
    parser reads (checked with a byte-level matcher over the call's text)."""
    tok, lltok = _byte_tokenizer()
    for mode in ("required", "auto"):
        for parallel in (True, False):
            for g in (call_grammar(fmt, TOOLS, mode, parallel),
                      with_thinking(call_grammar(fmt, TOOLS, mode, parallel), THINK, True)):
                err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.grammar_from("lark", g))
                assert not err, (msgs, g)
    texts = {HERMES.name: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             XML.name: "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
             LLAMA3_JSON.name: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
             TOOL_CALL_JSON.name: '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}
    bad = texts[fmt.name].replace("get_weather", "get_weathex")
    for text, ok in ((texts[fmt.name], True), (bad, False)):
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", call_grammar(fmt, TOOLS, "required", False)))
        accepted = all(m.consume_token(i) for i in tok.encode(text).ids)
        assert (accepted and m.is_accepting()) == ok, (text, m.get_error())
        if ok:    # the parser reads what the grammar let through
            assert parse(fmt, text).tool_calls == [PARIS]


def _byte_tokenizer():
    """A byte-level BPE vocabulary of the 256 bytes plus an end token, for llguidance."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):                       # GPT-2's byte -> character table
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=257, eos_token=256)

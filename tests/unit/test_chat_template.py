"""Chat rendering against transformers' apply_chat_template on the same template and messages."""

import json
import re
from datetime import datetime

import pytest

from rpcserver.errors import InvalidArgument
from services.tokenizer.chat_template import ChatTemplate

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "4."}
THOUGHTFUL_ANSWER = {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n\n4."}
FOLLOW_UP = {"role": "user", "content": "And 3+3? Reply in {{ jinja }} and <b>tags</b> — ünïcode 中文 🤗"}
CALL = {
    "role": "assistant",
    "content": "<think>\nI should look it up.\n</think>\n\n<tool_call>\n{\"name\": \"calc\"}\n</tool_call>",
}
REASONED = {"role": "assistant", "content": "ok", "reasoning_content": "hm"}
RESULT = {"role": "tool", "content": "{\"result\": 6}"}
SECOND_RESULT = {"role": "tool", "content": "done"}

CONVERSATIONS = {
    "single user": [USER],
    "system and user": [SYSTEM, USER],
    "multi-turn": [SYSTEM, USER, ANSWER, FOLLOW_UP],
    "past think block is dropped": [USER, THOUGHTFUL_ANSWER, FOLLOW_UP],
    "think block of the current turn is kept": [USER, CALL, RESULT, SECOND_RESULT],
    "tool results then an answer": [SYSTEM, FOLLOW_UP, CALL, RESULT, THOUGHTFUL_ANSWER],
    "reasoning_content field": [USER, {"role": "assistant", "content": "4.", "reasoning_content": "easy"}, FOLLOW_UP],
    "reasoning_content in the current turn": [USER, REASONED, RESULT],
    "trailing assistant": [USER, THOUGHTFUL_ANSWER],
    "later system message": [USER, ANSWER, SYSTEM, FOLLOW_UP],
}


def reference_render(hf_demo_tokenizer, messages, add_generation_prompt, enable_thinking):
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return hf_demo_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


@pytest.mark.parametrize("enable_thinking", [None, False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_render_matches_transformers(demo_tokenizer, hf_demo_tokenizer, name, add_generation_prompt, enable_thinking):
    messages = CONVERSATIONS[name]
    ours = demo_tokenizer.render_chat(messages, add_generation_prompt, enable_thinking)
    assert ours == reference_render(hf_demo_tokenizer, messages, add_generation_prompt, enable_thinking)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_encode_chat_matches_transformers_ids(demo_tokenizer, hf_demo_tokenizer, name):
    messages = CONVERSATIONS[name]
    ids, rendered = demo_tokenizer.encode_chat(messages, enable_thinking=False)
    expected = hf_demo_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     enable_thinking=False)
    assert ids == list(expected["input_ids"])
    assert rendered == reference_render(hf_demo_tokenizer, messages, True, False)


def test_qwen3_layout(demo_tokenizer):
    assert demo_tokenizer.render_chat([SYSTEM, USER], enable_thinking=False) == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = demo_tokenizer.render_chat([USER])
    assert thinking.endswith("<|im_start|>assistant\n")
    assert demo_tokenizer.render_chat([USER], enable_thinking=True) == thinking


def test_past_reasoning_is_stripped_and_current_kept(demo_tokenizer):
    past = demo_tokenizer.render_chat([USER, THOUGHTFUL_ANSWER, FOLLOW_UP])
    assert "<think>" not in past and "<|im_start|>assistant\n4.<|im_end|>" in past
    current = demo_tokenizer.render_chat([USER, CALL, RESULT], add_generation_prompt=False)
    assert "<think>\nI should look it up.\n</think>\n\n<tool_call>" in current
    assert current.endswith("<|im_start|>user\n<tool_response>\n{\"result\": 6}\n</tool_response><|im_end|>\n")


def test_chat_special_tokens_become_their_ids(demo_tokenizer):
    ids, _ = demo_tokenizer.encode_chat([USER], enable_thinking=False)
    assert ids[0] == 151644 and ids.count(151645) == 1
    assert 151667 in ids and 151668 in ids


HELPERS_TEMPLATE = (
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ eos_token }}|{{ pad_token }}"
    "|{{ bos_token is defined }}|{{ enable_thinking is defined }}|{{ strftime_now('%Y') }}"
    "{% for m in messages %}{% if loop.index0 > 0 %}{% break %}{% endif %}|{{ m.role }}{% endfor %}"
)


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}])
def test_helpers_match_transformers(demo_tokenizer_dir, hf_demo_tokenizer, extra):
    config = json.loads((demo_tokenizer_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "<tag> & \"quotes\" — 中文"}, ANSWER]
    ours = ChatTemplate(HELPERS_TEMPLATE, config).render(messages, **extra)
    expected = hf_demo_tokenizer.apply_chat_template(messages, chat_template=HELPERS_TEMPLATE, tokenize=False, **extra)
    assert ours == expected
    assert "中文" in ours and "<tag>" in ours and str(datetime.now().year) in ours


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — «quoted» <b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ASK = {"role": "user", "content": "Weather in Paris and Tōkyō, and the time?"}
CALLS = {"role": "assistant", "content": "", "tool_calls": [
    call("call_1", "get_weather", '{"city": "Paris"}'), call("call_2", "get_weather", '{"city": "Tōkyō", "unit": "c"}')]}
CALL_WITH_TEXT = {"role": "assistant", "content": "Let me check.", "tool_calls": [call("call_3", "now", "{}")]}
CALL_DICT_ARGS = {"role": "assistant", "content": "", "tool_calls": [call("call_4", "get_weather", {"city": "Oslo"})]}
ANSWERS = [{"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
           {"role": "tool", "tool_call_id": "call_2", "content": "25 C"}]

TOOL_CONVERSATIONS = {
    "tools offered": ([WEATHER, CLOCK], [ASK]),
    "tools with a system message": ([WEATHER], [SYSTEM, ASK]),
    "parallel calls and their results": ([WEATHER, CLOCK], [SYSTEM, ASK, CALLS, *ANSWERS]),
    "call with text, result, answer": ([CLOCK], [ASK, CALL_WITH_TEXT, {"role": "tool", "content": "12:00"},
                                                 {"role": "assistant", "content": "Noon."}, FOLLOW_UP]),
    "arguments as an object": ([WEATHER], [ASK, CALL_DICT_ARGS, {"role": "tool", "content": "rain"}]),
    "past calls without tools offered": (None, [ASK, CALLS, *ANSWERS]),
}


@pytest.mark.parametrize("enable_thinking", [None, False])
@pytest.mark.parametrize("name", TOOL_CONVERSATIONS)
def test_render_with_tools_matches_transformers(demo_tokenizer, hf_demo_tokenizer, name, enable_thinking):
    tools, messages = TOOL_CONVERSATIONS[name]
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = demo_tokenizer.render_chat(messages, True, enable_thinking, tools)
    expected = hf_demo_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                     **extra)
    assert ours == expected
    if tools:
        assert "<tools>\n{" in ours and all(f'"name": "{t["function"]["name"]}"' in ours for t in tools)


def test_encode_request_takes_tools_as_json(demo_tokenizer, hf_demo_tokenizer):
    tools, messages = TOOL_CONVERSATIONS["parallel calls and their results"]
    ids, rendered = demo_tokenizer.encode_request(messages=messages, tools=[json.dumps(t) for t in tools])
    expected = hf_demo_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    assert ids == list(expected["input_ids"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō", "unit": "c"}}\n</tool_call>' in rendered


@pytest.mark.parametrize("tools, message", [(["{nope"], "tools[0] is not valid JSON"),
                                            (["[1]"], "tools[0] must be a JSON object")])
def test_bad_tools_are_refused(demo_tokenizer, tools, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        demo_tokenizer.encode_request(messages=[ASK], tools=tools)


@pytest.fixture(scope="module")
def published_template():
    from tests.published_template import published_qwen3_template

    return published_qwen3_template()


@pytest.fixture(scope="module")
def published(tmp_path_factory, demo_tokenizer_dir, published_template):
    """Our tokenizer core and transformers' tokenizer, both on the demo vocabulary with Qwen3's published template."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from services.tokenizer.core import TokenizerCore

    folder = tmp_path_factory.mktemp("published_template")
    for f in demo_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = published_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=published_template,
                                        eos_token=config["eos_token"], pad_token=config["pad_token"])
    return TokenizerCore.from_dir(folder), reference


@pytest.mark.parametrize("enable_thinking", [None, False])
@pytest.mark.parametrize("name", [*TOOL_CONVERSATIONS, *CONVERSATIONS])
def test_render_on_the_published_qwen3_template_matches_transformers(published, published_template, name,
                                                                     enable_thinking):
    ours_core, reference = published
    tools, messages = TOOL_CONVERSATIONS[name] if name in TOOL_CONVERSATIONS else (None, CONVERSATIONS[name])
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = ours_core.render_chat(messages, True, enable_thinking, tools)
    expected = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **extra)
    assert ours == expected
    assert "<tool_call>" in published_template and "enable_thinking" in published_template  # Qwen3's, not another
    if tools:
        assert "<tools>\n{" in ours and all(f'"name": "{t["function"]["name"]}"' in ours for t in tools)

"""TokenizerCore's loading, info and request checks: a caller's mistakes become InvalidArgument."""

import json
import shutil

import pytest

from rpcserver.errors import InvalidArgument
from services.tokenizer.chat_template import ChatTemplate
from services.tokenizer.core import TokenizerCore

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def bare_dir(demo_tokenizer_dir, tmp_path_factory):
    """A checkpoint with tokenizer.json alone: no chat template, no generation config."""
    out = tmp_path_factory.mktemp("bare_tokenizer")
    shutil.copy(demo_tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return out


def test_info(demo_tokenizer):
    info = demo_tokenizer.info
    assert info.vocab_size == 151669
    assert info.eos_token_ids == [151645, 151643]
    assert info.has_chat_template
    specials = dict(info.special_tokens)
    assert len(specials) == 26
    assert specials[151643] == "<|endoftext|>" and specials[151645] == "<|im_end|>" and specials[151668] == "</think>"


def test_eos_from_a_single_id_and_from_tokenizer_config(bare_dir, tmp_path):
    assert TokenizerCore.from_dir(bare_dir).info.eos_token_ids == []
    shutil.copy(bare_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert TokenizerCore.from_dir(tmp_path).info.eos_token_ids == [151643]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645}))
    assert TokenizerCore.from_dir(tmp_path).info.eos_token_ids == [151645]


def test_chat_template_file_and_named_templates(bare_dir, tmp_path):
    shutil.copy(bare_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default:{{ eos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "eos_token": "<|im_end|>"}))
    assert TokenizerCore.from_dir(tmp_path).render_chat([USER]) == "default:<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    assert TokenizerCore.from_dir(tmp_path).render_chat([USER]) == "file:hi"


def test_encode_and_decode(demo_tokenizer):
    assert demo_tokenizer.encode("Hello world!") == [9707, 1879, 0]
    assert demo_tokenizer.encode("<|im_start|>user") == [151644, 872]
    assert demo_tokenizer.decode([151644, 872, 151645], skip_special_tokens=True) == "user"
    assert demo_tokenizer.decode([151667, 151645], skip_special_tokens=True) == "<think>"


def test_encode_request(demo_tokenizer):
    assert demo_tokenizer.encode_request(text="Hello world!") == ([9707, 1879, 0], "")
    ids, rendered = demo_tokenizer.encode_request(messages=[USER], enable_thinking=False)
    assert (ids, rendered) == demo_tokenizer.encode_chat([USER], enable_thinking=False)
    with pytest.raises(InvalidArgument, match="not both"):
        demo_tokenizer.encode_request(text="hi", messages=[USER])
    with pytest.raises(InvalidArgument, match="nothing to encode"):
        demo_tokenizer.encode_request(text="", messages=[])


@pytest.mark.parametrize("bad_id", [-1, 151669, 2**32, "7", 1.0])
def test_ids_outside_the_vocabulary(demo_tokenizer, bad_id):
    with pytest.raises(InvalidArgument, match=r"outside the vocabulary \(valid ids: 0..151668\)"):
        demo_tokenizer.decode([9707, bad_id])
    with pytest.raises(InvalidArgument, match="position 1"):
        demo_tokenizer.decode_incremental([9707, bad_id], 0)


def test_padding_ids_of_the_model_decode_to_nothing(bare_dir, tmp_path):
    shutil.copy(bare_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    core = TokenizerCore.from_dir(tmp_path)
    assert core.info.vocab_size == 151669
    assert core.decode([9707, 151700, 1879]) == "Hello world"
    assert core.decode_incremental([9707, 151935], 1) == ("", 1, 1)
    with pytest.raises(InvalidArgument, match=r"valid ids: 0..151935"):
        core.decode([151936])


@pytest.mark.parametrize("read_offset", [-1, 3])
def test_read_offset_outside_the_window(demo_tokenizer, read_offset):
    with pytest.raises(InvalidArgument, match="read_offset"):
        demo_tokenizer.decode_incremental([9707, 1879], read_offset)


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "at least one message"),
        ([{"role": "robot", "content": "beep"}], "role 'robot'; use one of system, user, assistant, tool"),
        ([USER, {"content": "no role"}], "message 1 has role None"),
        ([{"role": "user", "content": None}], "content as a string"),
        (["just text"], "mapping with role and content"),
    ],
)
def test_bad_messages(demo_tokenizer, messages, message):
    with pytest.raises(InvalidArgument, match=message):
        demo_tokenizer.render_chat(messages)


def test_chat_without_a_template(bare_dir):
    core = TokenizerCore.from_dir(bare_dir)
    assert not core.info.has_chat_template
    with pytest.raises(InvalidArgument, match="no chat template.*send plain text"):
        core.encode_chat([USER])
    assert core.encode("hi") == [6023]


def test_template_refusals_become_invalid_argument(demo_tokenizer):
    template = ChatTemplate("{{ raise_exception('this model takes no system messages') }}", {})
    core = TokenizerCore(demo_tokenizer.tokenizer, template, [])
    with pytest.raises(InvalidArgument, match="takes no system messages"):
        core.render_chat([USER])


def test_text_must_be_a_string(demo_tokenizer):
    with pytest.raises(InvalidArgument, match="text must be a string"):
        demo_tokenizer.encode(b"bytes")

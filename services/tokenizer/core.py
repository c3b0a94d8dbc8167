"""The tokenizer service's core: encode, chat rendering, decode and stateless incremental decode."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

from checkpoint.files import eos_token_ids, read_json
from rpcserver.errors import InvalidArgument
from services.tokenizer.byte_level import ByteLevelText
from services.tokenizer.chat_template import ChatTemplate
from services.tokenizer.embedding_config import EmbeddingConfig, EmbeddingConfigError

CHAT_ROLES = ("system", "user", "assistant", "tool")

# What a byte-level decode puts where a UTF-8 character is cut short.
REPLACEMENT_CHAR = "\ufffd"
# Windows up to this many ids are decoded in Python (byte-level vocabularies): quicker than a call into
# tokenizers for a few ids, and short enough to hold the GIL for.
SMALL_DECODE_IDS = 256


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    # (id, content) of every added token, special or not (Qwen3's <think> markers are not special).
    special_tokens: list[tuple[int, str]]
    eos_token_ids: list[int]
    has_chat_template: bool
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)  # Sentence Transformers' files, if any


def chat_template_source(checkpoint_dir: Path, tokenizer_config: dict) -> str | None:
    """The checkpoint's default chat template, wherever transformers would have saved it."""
    template_file = checkpoint_dir / "chat_template.jinja"
    if template_file.is_file():
        # Newer transformers save the template beside tokenizer_config.json, and prefer that file.
        return template_file.read_text(encoding="utf-8")
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        # Several named templates: chat uses the one named "default".
        source = next((entry["template"] for entry in source if entry.get("name") == "default"), None)
    return source if isinstance(source, str) else None


class TokenizerLoadError(ValueError):
    """The checkpoint's tokenizer.json is missing or unreadable."""


class TokenizerCore:
    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        eos_token_ids: list[int],
        model_vocab_size: int | None = None,
        embedding: EmbeddingConfig | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # The model's embedding is often padded past the tokenizer (Qwen3: 151,936 rows for 151,669
        # ids). A model, random weights above all, can sample those padding ids; they decode to
        # nothing, as in HF tokenizers, rather than fail the stream.
        self.id_limit = max(self.vocab_size, model_vocab_size or 0)
        self.byte_level = ByteLevelText.of(tokenizer)
        added = sorted(tokenizer.get_added_tokens_decoder().items())
        self.info = TokenizerInfo(
            vocab_size=self.vocab_size,
            special_tokens=[(token_id, token.content) for token_id, token in added],
            eos_token_ids=eos_token_ids,
            has_chat_template=chat_template is not None,
            embedding=embedding or EmbeddingConfig(),
        )

    @classmethod
    def from_dir(cls, checkpoint_dir: Path | str) -> "TokenizerCore":
        """Load tokenizer.json, plus tokenizer_config.json, generation_config.json, config.json and Sentence
        Transformers' files when present."""
        checkpoint_dir = Path(checkpoint_dir)
        path = checkpoint_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(f"{checkpoint_dir} has no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any unreadable file
            raise TokenizerLoadError(f"cannot read {path}: {e}") from None
        tokenizer_config = read_json(checkpoint_dir / "tokenizer_config.json")
        model_config = read_json(checkpoint_dir / "config.json")

        source = chat_template_source(checkpoint_dir, tokenizer_config)
        chat_template = ChatTemplate(source, tokenizer_config) if source is not None else None

        try:
            embedding = EmbeddingConfig.from_dir(checkpoint_dir)
        except EmbeddingConfigError as e:
            raise TokenizerLoadError(f"{checkpoint_dir}: {e}") from None
        return cls(tokenizer, chat_template, eos_token_ids(checkpoint_dir), model_config.get("vocab_size"), embedding)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a string, got {type(text).__name__}")
        # encode_batch lets go of the GIL while it works (encode holds it), so an encode on a worker thread
        # leaves the server's event loop running; the ids are the same.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text the checkpoint's chat template makes of `messages`."""
        if self.chat_template is None:
            raise InvalidArgument(
                "this checkpoint has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json): send plain text instead of messages"
            )
        check_messages(messages)
        # Passed only when set, so the template's `enable_thinking is defined` falls back to its default.
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **extra)
        except jinja2.TemplateError as error:
            raise InvalidArgument(f"the chat template rejected these messages: {error}") from error

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[list[int], str]:
        """(ids, rendered text); the template already wrote every special token, so none are added."""
        rendered = self.render_chat(messages, add_generation_prompt, enable_thinking, tools)
        return self.encode(rendered, add_special_tokens=False), rendered

    def encode_request(
        self,
        text: str | None = None,
        messages: list[dict] | None = None,
        add_special_tokens: bool = False,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[str] | None = None,
    ) -> tuple[list[int], str]:
        """(ids, rendered) for exactly one of `text` and `messages`; empty counts as absent, as in proto3.

        `tools` are OpenAI tool objects as JSON text, rendered by the chat template.
        """
        if text and messages:
            raise InvalidArgument("give either text or messages, not both")
        if tools and not messages:
            raise InvalidArgument("tools need messages: plain text is not rendered with the chat template")
        if messages:
            return self.encode_chat(messages, add_generation_prompt, enable_thinking, parse_tools(tools or []))
        if text:
            return self.encode(text, add_special_tokens), ""
        raise InvalidArgument("nothing to encode: give a non-empty text or at least one message")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; a cut or invalid UTF-8 sequence becomes U+FFFD."""
        self.check_ids(ids)
        return self._decode(ids, skip_special_tokens)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self.byte_level is not None and len(ids) <= SMALL_DECODE_IDS:
            return self.byte_level.decode(ids, skip_special_tokens)
        # decode_batch, as encode_batch above: it lets go of the GIL, decode does not.
        return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def decode_incremental(
        self, token_ids: list[int], read_offset: int, skip_special_tokens: bool = False, final: bool = False
    ) -> tuple[str, int, int]:
        """(new_text, prefix_advance, new_read_offset) for a stream window; see DecodeIncremental in the proto.

        The ids before `read_offset` were already turned into text; decoding them together with
        the new ids, then cutting off their text, gives the new ids' text as a full decode would.
        """
        self.check_ids(token_ids)
        if not 0 <= read_offset <= len(token_ids):
            raise InvalidArgument(f"read_offset {read_offset} must lie between 0 and the {len(token_ids)} ids sent")
        prefix_text = self._decode(token_ids[:read_offset], skip_special_tokens)
        full_text = self._decode(token_ids, skip_special_tokens)
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            # Most likely a character split across tokens: hold it until the rest arrives.
            return "", 0, read_offset
        if full_text.startswith(prefix_text):
            new_text = full_text[len(prefix_text) :]
        else:
            # Only when a caller's first read_offset cuts a character: emit from where the texts part.
            new_text = full_text[common_prefix_length(prefix_text, full_text) :]
        return new_text, read_offset, len(token_ids) - read_offset

    def check_ids(self, ids: list[int]) -> None:
        try:  # the usual case, every id an int in range, checked in C
            if not ids or (min(ids) >= 0 and max(ids) < self.id_limit and set(map(type, ids)) == {int}):
                return
        except TypeError:  # ids that do not compare: the loop below names the first bad one
            pass
        for position, token_id in enumerate(ids):
            if not isinstance(token_id, int) or not 0 <= token_id < self.id_limit:
                raise InvalidArgument(
                    f"token id {token_id!r} at position {position} is outside the vocabulary "
                    f"(valid ids: 0..{self.id_limit - 1})"
                )


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise InvalidArgument("messages is empty: send at least one message")
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"message {position} must be a mapping with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"message {position} has role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise InvalidArgument(f"message {position} ({role}) needs its content as a string")


def parse_tools(tools: list[str]) -> list[dict]:
    parsed = []
    for position, text in enumerate(tools):
        try:
            tool = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"tools[{position}] is not valid JSON: {e}") from None
        if not isinstance(tool, dict):
            raise InvalidArgument(f"tools[{position}] must be a JSON object (an OpenAI tool)")
        parsed.append(tool)
    return parsed


def common_prefix_length(a: str, b: str) -> int:
    length = 0
    for char_a, char_b in zip(a, b):
        if char_a != char_b:
            break
        length += 1
    return length

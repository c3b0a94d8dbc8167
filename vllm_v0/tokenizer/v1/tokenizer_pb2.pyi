from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("text", "messages", "add_special_tokens", "add_generation_prompt", "enable_thinking", "tools")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_special_tokens: bool
    add_generation_prompt: bool
    enable_thinking: bool
    tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., enable_thinking: _Optional[bool] = ..., tools: _Optional[_Iterable[str]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids", "rendered")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RENDERED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rendered: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rendered: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DecodeIncrementalRequest(_message.Message):
    __slots__ = ("token_ids", "read_offset", "skip_special_tokens", "final")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    READ_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    read_offset: int
    skip_special_tokens: bool
    final: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., read_offset: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., final: _Optional[bool] = ...) -> None: ...

class DecodeIncrementalResponse(_message.Message):
    __slots__ = ("text", "prefix_advance", "read_offset")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ADVANCE_FIELD_NUMBER: _ClassVar[int]
    READ_OFFSET_FIELD_NUMBER: _ClassVar[int]
    text: str
    prefix_advance: int
    read_offset: int
    def __init__(self, text: _Optional[str] = ..., prefix_advance: _Optional[int] = ..., read_offset: _Optional[int] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "final", "piece_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    PIECE_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    final: bool
    piece_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., final: _Optional[bool] = ..., piece_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("text", "pieces")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    text: str
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, text: _Optional[str] = ..., pieces: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DecodeBatchItem(_message.Message):
    __slots__ = ("stream_id", "token_ids", "final", "skip_special_tokens", "piece_ids", "close")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIECE_IDS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    skip_special_tokens: bool
    piece_ids: _containers.RepeatedScalarFieldContainer[int]
    close: bool
    def __init__(self, stream_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., piece_ids: _Optional[_Iterable[int]] = ..., close: _Optional[bool] = ...) -> None: ...

class DecodeBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DecodeBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DecodeBatchItem, _Mapping]]] = ...) -> None: ...

class DecodeBatchResult(_message.Message):
    __slots__ = ("stream_id", "text", "pieces", "error_code", "error_message", "more")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    text: str
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    error_code: int
    error_message: str
    more: bool
    def __init__(self, stream_id: _Optional[int] = ..., text: _Optional[str] = ..., pieces: _Optional[_Iterable[bytes]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., more: _Optional[bool] = ...) -> None: ...

class DecodeBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DecodeBatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DecodeBatchResult, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("id", "content")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    content: str
    def __init__(self, id: _Optional[int] = ..., content: _Optional[str] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("vocab_size", "special_tokens", "eos_token_ids", "has_chat_template", "embedding_prompts", "default_embedding_prompt_name", "embedding_modules", "embedding_pooling_modes")
    class EmbeddingPromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_EMBEDDING_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_MODULES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_POOLING_MODES_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    embedding_prompts: _containers.ScalarMap[str, str]
    default_embedding_prompt_name: str
    embedding_modules: _containers.RepeatedScalarFieldContainer[str]
    embedding_pooling_modes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, vocab_size: _Optional[int] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., embedding_prompts: _Optional[_Mapping[str, str]] = ..., default_embedding_prompt_name: _Optional[str] = ..., embedding_modules: _Optional[_Iterable[str]] = ..., embedding_pooling_modes: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

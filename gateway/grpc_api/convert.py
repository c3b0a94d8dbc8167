"""Turns the public GenerateRequest proto into the gateway's GenerationRequest."""

from gateway.core.tools import ToolCall
from gateway.core.validation import GenerationRequest
from rpcserver.shared import SAMPLING_FIELDS
from vllm_v0.gateway.v1 import gateway_pb2

# proto3 `optional` scalars: HasField tells "unset" from a zero the client chose.
_OPTIONAL_FIELDS = ("enable_thinking", "max_tokens", *SAMPLING_FIELDS, "logprobs", "prompt_logprobs")


def from_proto(msg: gateway_pb2.GenerateRequest) -> GenerationRequest:
    """Copies the fields across; range checks are validate()'s job, not this one's."""
    optional = {name: getattr(msg, name) if msg.HasField(name) else None for name in _OPTIONAL_FIELDS}
    messages = [(m.role, m.content) for m in msg.messages] or None
    # proto3 cannot tell an empty `prompt` or `messages` from one not sent: both empty is neither given,
    # which validate() says naming both.
    prompt = msg.prompt or None
    tools = list(msg.tools)
    return GenerationRequest(
        tools=tools,
        tool_choice=msg.tool_choice or "auto",  # with no tools, nothing is offered either way
        parallel_tool_calls=msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True,
        message_tool_calls={i: [ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls]
                            for i, m in enumerate(msg.messages) if m.tool_calls},
        tool_call_ids={i: m.tool_call_id for i, m in enumerate(msg.messages) if m.tool_call_id},
        prompt=prompt,
        messages=messages,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        request_id=msg.request_id,
        logit_bias=dict(msg.logit_bias),
        structured_output=structured_output(msg.structured_output),
        adapter=msg.adapter,
        **optional,
    )


def structured_output(message: gateway_pb2.StructuredOutput) -> tuple[str, object] | None:
    """The oneof as (kind, value); None when no form is set or json_object is false."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    if kind == "choice":
        return kind, list(message.choice.choices)
    return kind, getattr(message, kind)

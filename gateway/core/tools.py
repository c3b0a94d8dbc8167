"""The request side of tool calling: checking `tools` and `tool_choice`, and what the prompt offers."""
from __future__ import annotations

import json
from dataclasses import dataclass

from rpcserver.errors import InvalidArgument

TOOL_CHOICES = ("auto", "none", "required")  # or the name of one offered function


@dataclass
class ToolCall:
    """A call an assistant made, as a later request sends it back in the conversation."""

    id: str
    name: str
    arguments: str  # the arguments' JSON text


def tool_names(tools: list[str]) -> list[str]:
    """The offered functions' names; raises InvalidArgument naming the first tool that is not an OpenAI function."""
    names = []
    for i, text in enumerate(tools):
        try:
            tool = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"tools[{i}] is not valid JSON: {e}") from None
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidArgument(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                  f'"parameters": ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    return names


def check_tools(tools: list[str], tool_choice: str) -> None:
    names = tool_names(tools)
    if tool_choice in TOOL_CHOICES:
        if tool_choice == "required" and not tools:
            raise InvalidArgument('tool_choice is "required" but no tools are given')
        return
    if tool_choice not in names:
        raise InvalidArgument(f"tool_choice must be auto, none, required or the name of a given tool; "
                              f"{tool_choice!r} is none of these")


def offered_tools(tools: list[str], tool_choice: str) -> list[str]:
    """The tools the prompt shows the model: none with tool_choice "none", as OpenAI does."""
    return [] if tool_choice == "none" else list(tools)


def is_forced(tool_choice: str) -> bool:
    """Whether the choice forces calls: "required" or a named function."""
    return tool_choice not in ("auto", "none")


def forced_call_constraint(tools: list[str], tool_choice: str) -> dict | None:
    """For "required" or a named function: the structural tag that must constrain the output, else None.

    The output stays in Qwen3's own format, so the prompt and the parser are those of "auto":
    each call is `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, with the arguments
    valid against the function's parameter schema. This is the shape of vLLM's and xgrammar's
    `structural_tag` format; the worker's structured-output engine has to enforce it from the
    first token after the reasoning ends (see `constrain` in gateway/core/generation.py).
    """
    if not is_forced(tool_choice):
        return None
    structures = []
    for text in tools:
        function = json.loads(text)["function"]
        if tool_choice != "required" and function["name"] != tool_choice:
            continue
        schema = {"type": "object", "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}
        structures.append({"begin": "<tool_call>\n", "schema": schema, "end": "\n</tool_call>"})
    # A named function is called once, as OpenAI and vLLM do; "required" allows parallel calls.
    return {"type": "structural_tag", "structures": structures, "triggers": ["<tool_call>"],
            "at_least_one": True, "stop_after_first": tool_choice != "required"}


# llguidance's JSON options (the worker's executor/grammar.py uses the same for JSON schemas).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def tool_call_grammar(constraint: dict, parallel: bool, after_reasoning: bool = False) -> str:
    """The forced-call constraint as a Lark grammar for the worker's structured-output engine.

    One `<tool_call>` block, or several on their own lines when parallel calls are allowed (and the
    constraint is "required", not a named function); each block's JSON must match one of the
    structures' schemas (the name and the function's parameters), compiled compact by llguidance's
    `%json`. `<tool_call>` and `</tool_call>` are Qwen3's own tokens, so the grammar names them as
    tokens (unquoted): llguidance will not spell a special token's text out of other tokens.
    The grammar ends with the last call: once it is complete the matcher admits only an end-of-
    sequence token, so nothing, not even whitespace, follows the forced calls.
    `after_reasoning`: the grammar starts right after the model's `</think>`, where Qwen3 writes a blank
    line before its answer; that line is allowed (at most two newlines), so the model keeps its own format.
    """
    rules = []
    for i, structure in enumerate(constraint["structures"]):
        assert (structure["begin"], structure["end"]) == ("<tool_call>\n", "\n</tool_call>")
        rules.append(f'call{i}: <tool_call> "\\n" json{i} "\\n" </tool_call>')
        # Compact JSON, as every structured output here: no whitespace between JSON tokens.
        schema = {**structure["schema"], "x-guidance": COMPACT_JSON}
        rules.append(f"json{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call{i}" for i in range(len(constraint["structures"])))
    many = parallel and not constraint.get("stop_after_first", False)
    start = "start: " + ("BLANK? " if after_reasoning else "") + ('call ("\\n" call)*' if many else "call")
    if after_reasoning:
        rules.append("BLANK: /\\n\\n?/")
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"

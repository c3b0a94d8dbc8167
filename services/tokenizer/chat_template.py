"""Renders a checkpoint's Jinja chat template the way transformers' apply_chat_template does."""

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from checkpoint.files import special_token_text

# The named special tokens transformers hands to every template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes <, > and &, which would corrupt prompts; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class SafeNamespace(jinja2.utils.Namespace):
    """A template `namespace()` that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):
        # Same positional trick as Jinja's Namespace, so a template may still pass `self=...`.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            SafeNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        SafeNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set an underscore name: {name!r}")


def template_environment() -> ImmutableSandboxedEnvironment:
    # A chat template is code from the checkpoint, so it runs sandboxed; the whitespace flags are
    # what template authors write against.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = SafeNamespace
    return env


class ChatTemplate:
    """A compiled chat template plus the special tokens it is rendered with."""

    def __init__(self, source: str, tokenizer_config: dict):
        self.template = template_environment().from_string(source)
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := special_token_text(tokenizer_config.get(name))) is not None
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None,
               **template_kwargs) -> str:
        """Render `messages` (and `tools`, OpenAI tool objects); only the kwargs given reach the template,
        so `x is defined` checks work."""
        # As transformers does: a None field is treated as absent, which templates handle better.
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        variables = {**self.special_tokens, **template_kwargs}
        return self.template.render(
            messages=messages, tools=tools or None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )

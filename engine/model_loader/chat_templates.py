"""Which chat template a model chats with: the user's, the model's own, or a built-in one.

    choice = choose_chat_template(tokenizer, model_type, flag)   # flag: --chat-template
    choice.template      # Jinja source (None: this model cannot chat; /v1/completions only)
    choice.source        # "the model's", "built-in gemma (the model has none)", "--chat-template FILE"
    choice.stop_tokens   # the template's end-of-turn markers: they stop a request

Order: `--chat-template` (a built-in's name, a file, or the Jinja text itself, as vLLM
and llama-server take it), else the template the model carries (tokenizer_config.json,
a GGUF's tokenizer.chat_template), else the built-in of the model's family, else the
first built-in whose markers are all in the vocabulary. A built-in is never chosen
when its markers are not real tokens of the vocabulary (its turns would be plain text
the model never saw). Example, the Gemma 3 270M GGUF (no template in its metadata,
architecture gemma3, vocabulary with <start_of_turn> and <end_of_turn>): built-in
"gemma", and <end_of_turn> stops a request with finish_reason "stop".

Every template is checked once at start-up (`check_chat_template`): it must parse and
render a conversation with a system message; a broken one is a ChatTemplateError whose
message is one line naming the template's line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


class ChatTemplateError(ValueError):
    """A --chat-template (or a model's template) that cannot be used; a one-line message."""


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values of the family
    markers: tuple[str, ...]  # special tokens it writes: each must be in the vocabulary
    stops: tuple[str, ...]  # the markers that end an assistant turn
    source: str


# Gemma 2 / 3 (instruction-tuned): user and model turns, a system message folded into the
# first user turn, content trimmed, roles alternating. Example, [system S, user U]:
#   <bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n
GEMMA = BuiltinTemplate("gemma", ("gemma", "gemma2", "gemma3", "gemma3_text"),
                        ("<start_of_turn>", "<end_of_turn>"), ("<end_of_turn>",), """\
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set first_user_prefix = messages[0]['content'] ~ '\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
  {%- endif -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<start_of_turn>' ~ role ~ '\\n' ~ (first_user_prefix if loop.first else '') -}}
  {{- message['content'] | trim -}}
  {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
""")

# Llama 3 / 3.1 / 3.2: headers per turn, content trimmed, <|eot_id|> after each; tools
# (3.1's JSON tool calling) listed in the system turn, calls as {"name", "parameters"}
# JSON, results as ipython turns. Example, [system S, user U]:
#   <|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>
#   <|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n
LLAMA3 = BuiltinTemplate("llama3", ("llama",),
                         ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                         ("<|eot_id|>", "<|eom_id|>"), """\
{{- bos_token -}}
{%- set ns = namespace(system=messages[0]['content'] | trim if messages and messages[0]['role'] == 'system' else '') -%}
{%- set loop_messages = messages[1:] if messages and messages[0]['role'] == 'system' else messages -%}
{%- if tools -%}
  {%- set ns.system = (ns.system ~ '\\n\\n' if ns.system else '') ~ 'You have access to the following functions. To call a function, respond with a JSON object of the form {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' -%}
  {%- for tool in tools -%}
    {%- set ns.system = ns.system ~ (tool | tojson(indent=4)) ~ '\\n\\n' -%}
  {%- endfor -%}
{%- endif -%}
{%- if ns.system -%}
  {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' ~ (ns.system | trim) ~ '<|eot_id|>' -}}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'tool' -%}
    {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' ~ (message['content'] | trim) ~ '<|eot_id|>' -}}
  {%- elif message.get('tool_calls') -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
    {%- for call in message['tool_calls'] -%}
      {%- set function = call['function'] if call.get('function') else call -%}
      {%- set arguments = function['arguments'] if function['arguments'] is string else function['arguments'] | tojson -%}
      {{- '{"name": "' ~ function['name'] ~ '", "parameters": ' ~ arguments ~ '}' -}}
    {%- endfor -%}
    {{- '<|eot_id|>' -}}
  {%- else -%}
    {{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n' ~ (message['content'] | trim) ~ '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- endif -%}
""")

# ChatML (Qwen2 / Qwen3, SmolLM, Hermes): <|im_start|>role\n...<|im_end|>\n per turn;
# tools as Hermes / Qwen write them (<tools> JSON lines in the system turn, calls in
# <tool_call> tags, results in <tool_response> tags in a user turn). Example, [system
# S, user U]: <|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n
CHATML = BuiltinTemplate("chatml", ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"),
                         ("<|im_start|>", "<|im_end|>"), ("<|im_end|>",), """\
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}
{%- set loop_messages = messages[1:] if system is not none else messages -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' ~ (system ~ '\\n\\n' if system else '') -}}
  {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\\n' ~ (tool | tojson) -}}
  {%- endfor -%}
  {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif system is not none -%}
  {{- '<|im_start|>system\\n' ~ system ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'tool' -%}
    {%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\\n<tool_response>\\n' ~ message['content'] ~ '\\n</tool_response>' -}}
    {%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}
      {{- '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ (message['content'] or '') -}}
    {%- for call in message.get('tool_calls') or [] -%}
      {%- set function = call['function'] if call.get('function') else call -%}
      {%- set arguments = function['arguments'] if function['arguments'] is string else function['arguments'] | tojson -%}
      {{- ('\\n' if message['content'] or not loop.first else '') ~ '<tool_call>\\n{"name": "' ~ function['name'] ~ '", "arguments": ' ~ arguments ~ '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""")

# Phi-3 / Phi-3.5 / Phi-4-mini: <|role|>\n...<|end|>\n per turn. Example, [system S,
# user U]: <|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n
PHI = BuiltinTemplate("phi3", ("phi3",), ("<|user|>", "<|assistant|>", "<|end|>"), ("<|end|>",),
                      """\
{%- for message in messages -%}
  {%- if message['role'] in ('system', 'user', 'assistant') -%}
    {{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>\\n' -}}
{%- else -%}
  {{- eos_token -}}
{%- endif -%}
""")

# Mistral Instruct (v0.3 and the [INST] family): [INST] user [/INST] answer</s>, a
# system message put before the last user turn. Example, [system S, user U]:
#   <s>[INST] S\n\nU[/INST]
MISTRAL = BuiltinTemplate("mistral", ("mistral", "mixtral"), ("[INST]", "[/INST]"), (), """\
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}
{%- set loop_messages = messages[1:] if system is not none else messages -%}
{%- set last_user = namespace(index=-1) -%}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'user' -%}{%- set last_user.index = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'user' -%}
    {%- if system is not none and loop.index0 == last_user.index -%}
      {{- '[INST] ' ~ system ~ '\\n\\n' ~ message['content'] ~ '[/INST]' -}}
    {%- else -%}
      {{- '[INST] ' ~ message['content'] ~ '[/INST]' -}}
    {%- endif -%}
  {%- elif message['role'] == 'assistant' -%}
    {{- ' ' ~ (message['content'] | trim) ~ eos_token -}}
  {%- endif -%}
{%- endfor -%}
""")

BUILTIN_TEMPLATES = {t.name: t for t in (GEMMA, LLAMA3, CHATML, PHI, MISTRAL)}
# The order a model with no family match tries them in (by its vocabulary).
FALLBACK_ORDER = ("chatml", "llama3", "gemma", "phi3", "mistral")


@dataclass(frozen=True)
class ChatTemplateChoice:
    template: str | dict[str, str] | None  # a dict: the model's named templates
    source: str
    stop_tokens: tuple[str, ...] = ()
    builtin: str | None = None  # the built-in's name, where one was chosen


def _has_markers(tokenizer, template: BuiltinTemplate) -> bool:
    vocab = tokenizer.get_vocab()
    return all(marker in vocab for marker in template.markers)


def _builtin_for(tokenizer, model_type: str | None) -> BuiltinTemplate | None:
    family = [t for t in BUILTIN_TEMPLATES.values() if model_type in t.model_types]
    for template in family + [BUILTIN_TEMPLATES[name] for name in FALLBACK_ORDER]:
        if _has_markers(tokenizer, template):
            return template
    return None


def _from_flag(tokenizer, flag: str) -> ChatTemplateChoice:
    if flag in BUILTIN_TEMPLATES:
        template = BUILTIN_TEMPLATES[flag]
        if not _has_markers(tokenizer, template):
            missing = [m for m in template.markers if m not in tokenizer.get_vocab()]
            raise ChatTemplateError(f"--chat-template {flag}: this model's vocabulary has no "
                                    f"{', '.join(missing)}")
        return ChatTemplateChoice(template.source, f"built-in {flag} (--chat-template)",
                                  template.stops, flag)
    if os.path.isfile(flag):
        try:
            with open(flag, encoding="utf-8") as f:
                return ChatTemplateChoice(f.read(), f"--chat-template {flag}")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {flag}: cannot read it: {exc}") from None
    if "{{" in flag or "{%" in flag:
        return ChatTemplateChoice(flag, "--chat-template (inline)")
    raise ChatTemplateError(f"--chat-template {flag!r}: not a file, a built-in "
                            f"({', '.join(BUILTIN_TEMPLATES)}) or a Jinja template")


def choose_chat_template(tokenizer, model_type: str | None,
                         flag: str | None = None) -> ChatTemplateChoice:
    """The template `tokenizer` chats with (see the module doc); ChatTemplateError for a
    --chat-template that is no name, file or Jinja text."""
    if flag:
        return _from_flag(tokenizer, flag)
    own = getattr(tokenizer, "chat_template", None)  # a str, or a dict of named ones
    if own and (not isinstance(own, str) or own.strip()):
        return ChatTemplateChoice(own, "the model's")
    template = _builtin_for(tokenizer, model_type)
    if template is None:
        return ChatTemplateChoice(None, "none (the model has none, and no built-in's markers "
                                        "are in its vocabulary)")
    return ChatTemplateChoice(template.source, f"built-in {template.name} (the model has none)",
                              template.stops, template.name)


SAMPLE_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def check_chat_template(tokenizer, template: str | dict[str, str], source: str) -> None:
    """Render SAMPLE_CONVERSATION with `template` through the tokenizer (as requests
    will); ChatTemplateError, one line naming `source` and the template's line, when it
    does not parse, raises, or renders nothing."""
    try:
        text = tokenizer.apply_chat_template(
            SAMPLE_CONVERSATION, chat_template=template if isinstance(template, str) else None,
            tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's TemplateSyntaxError carries the line
        line = getattr(exc, "lineno", None)
        where = f" line {line}" if line else ""
        message = " ".join(str(getattr(exc, "message", None) or exc).split())
        raise ChatTemplateError(f"chat template ({source}){where}: {message}") from None
    if not isinstance(text, str) or not text.strip():
        raise ChatTemplateError(f"chat template ({source}) renders nothing for a "
                                "system + user + assistant + user conversation")


# --chat-template-content-format auto: "openai" (a list of {"type": "text", ...} parts)
# for templates that loop over a message's content, else "string". Example:
#   {% for part in message['content'] %}  -> openai;   {{ message['content'] }} -> string
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content\b)")


def content_format(template: str | dict[str, str] | None, flag: str = "auto") -> str:
    """"string" or "openai": how message content reaches the template."""
    if flag != "auto":
        return flag
    sources = template.values() if isinstance(template, dict) else [template or ""]
    return "openai" if any(_LOOPS_OVER_CONTENT.search(t) for t in sources) else "string"

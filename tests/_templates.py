"""Chat templates written for the tests, in the style of the real checkpoints' (Jinja, as tokenizer_config.json holds
them). Each names the special tokens it writes in ``<NAME>_TOKENS`` and the bos/eos it expects in ``<NAME>_SPECIAL``.

- :data:`CHATML`: Qwen2-style ``<|im_start|>role\\n...<|im_end|>\\n``, a default system message when none is given.
- :data:`LLAMA3`: Llama-3-style header ids, ``<|eot_id|>`` after each message, ``bos_token`` first, contents trimmed.
- :data:`MISTRAL`: ``[INST] ... [/INST]``, the system message folded into the first user message, ``raise_exception``
  when roles do not alternate user/assistant.
- :data:`GPT2_DEMO`: the demo checkpoint's (server_models/chat/demo_gpt2/tokenizer_config.json):
  ``<|role|>text<|end|>``; with tools, Hermes-style (tools in the system turn, ``<tool_call>`` blocks, a tool result
  as a user turn in ``<tool_response>``), and without tools exactly what it was before tools.
- :data:`REWRITING`: ChatML-like, but an assistant reply *followed by a later user message* loses its content (as
  reasoning templates drop old thinking), and only the latest user message is marked: a conversation's next prompt
  is not an extension of the last one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

CHATML: Final = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHATML_TOKENS: Final = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHATML_SPECIAL: Final = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

LLAMA3: Final = """\
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_TOKENS: Final = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
LLAMA3_SPECIAL: Final = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

MISTRAL: Final = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate '
                            'user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, after an optional system message!') }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_TOKENS: Final = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")
MISTRAL_SPECIAL: Final = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

GPT2_DEMO: Final = (
    "{%- if tools is not none %}"
    "{{- '<|system|>' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, write a JSON object with the function\\'s name and arguments within "
    "<tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n"
    "</tool_call><|end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools is not none %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|assistant|>' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' + "
    "(call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|user|><tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>' }}"
    "{%- elif message['role'] in ['system', 'user'] %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- else %}{{- raise_exception('Roles are system, user, assistant and tool, got ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
GPT2_DEMO_TOKENS: Final = ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
GPT2_DEMO_SPECIAL: Final = {"eos_token": "<|end|>"}

REWRITING: Final = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = messages | length - 1 - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_user %}
        {{- '<|im_start|>assistant\\n<|im_end|>\\n' }}
    {%- elif message.role == 'user' and loop.index0 == ns.last_user %}
        {{- '<|im_start|>user (latest)\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
REWRITING_TOKENS: Final = CHATML_TOKENS
REWRITING_SPECIAL: Final = CHATML_SPECIAL

#: name -> (template, its special tokens, tokenizer_config.json's named special tokens)
TEMPLATES: Final = {
    "chatml": (CHATML, CHATML_TOKENS, CHATML_SPECIAL),
    "llama3": (LLAMA3, LLAMA3_TOKENS, LLAMA3_SPECIAL),
    "mistral": (MISTRAL, MISTRAL_TOKENS, MISTRAL_SPECIAL),
    "gpt2_demo": (GPT2_DEMO, GPT2_DEMO_TOKENS, GPT2_DEMO_SPECIAL),
    "rewriting": (REWRITING, REWRITING_TOKENS, REWRITING_SPECIAL),
}


def demo_template() -> str:
    """The chat template committed with the demo checkpoint (the test checks it is :data:`GPT2_DEMO`)."""
    import json

    path = Path(__file__).resolve().parents[1] / "server_models" / "chat" / "demo_gpt2" / "tokenizer_config.json"
    return str(json.loads(path.read_text(encoding="utf-8"))["chat_template"])

"""The chat template the training proxy renders with when the policy's tokenizer has none (the tiny policy
Sleuth builds, a base model): ChatML in Qwen2.5's shape with tools. Tools are listed in the system turn,
turns are ``<|im_start|>role\n...`` closed by the tokenizer's EOS token, an assistant's ``tool_calls`` are
written as ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` after its content (the format
:func:`agent.external.stitch.parse_tool_calls` reads, so a call the policy wrote renders back as it was
sampled), and consecutive tool results share one user turn inside ``<tool_response>``. Follows Qwen2.5's
template.
"""

from __future__ import annotations

CHATML_TOOL_CALLS = (
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
)

CHATML_HEAD = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool inside <tool_call></tool_call> tags.' + eos_token + '\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + eos_token + '\\n' }}"
    "{%- endif %}"
)

CHATML_TOOL_RESULT = (
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- eos_token + '\\n' }}{%- endif %}"
)

CHATML_TOOLS = (
    CHATML_HEAD
    + "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}" + CHATML_TOOL_CALLS + "{{- eos_token + '\\n' }}"
    + CHATML_TOOL_RESULT
    + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

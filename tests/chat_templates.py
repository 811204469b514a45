"""Chat templates of three families, and the recording and scripted backends the proxy tests use.

The templates, written here for the tiny test tokenizer (no download), with tools:

* ``CHATML_TOOLS`` (the one the proxy uses for a tokenizer without a template,
  :mod:`agent.external.chat_template`): Qwen2.5's shape: tools listed in the system turn, ``<|im_start|>role\\n...`` turns closed
  by the EOS token, an assistant's ``tool_calls`` written as ``<tool_call>{"name", "arguments"}</tool_call>``
  after its content, consecutive tool results in one user turn inside ``<tool_response>``;
* ``QWEN3_TOOLS``: the same with Qwen3's reasoning rule: an assistant message's ``<think>`` block is kept only
  after the last user message and dropped from earlier rounds (history is rewritten when a user speaks again);
* ``LLAMA3_TOOLS``: Llama 3.1's shape: ``<|start_header_id|>role<|end_header_id|>\\n\\n`` headers, contents
  trimmed, turns closed by the EOS token, tools in the system turn, tool calls as a bare
  ``{"name", "parameters"}`` object and tool results as ``ipython`` turns.
"""

from __future__ import annotations

from agent.external.chat_template import CHATML_HEAD, CHATML_TOOL_RESULT, CHATML_TOOLS
from agent.llm import Generation, decode, encode

__all__ = ["CHATML_TOOLS", "FAMILIES", "LLAMA3_TOOLS", "QWEN3_TOOLS", "Recording", "ScriptedSampler"]

QWEN3_TOOLS = (
    CHATML_HEAD
    + "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- set c, r = m.content, '' %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if r and loop.index0 > ns.last_user %}{{- '<think>\\n' + r + '\\n</think>\\n\\n' }}{%- endif %}{{- c }}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function %}{%- if c or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- eos_token + '\\n' }}"
    + CHATML_TOOL_RESULT
    + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TOOLS = (
    "{%- set sys = messages[0].content | trim if messages[0].role == 'system' else '' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\nRespond with a JSON object {\"name\": function name, "
    "\"parameters\": arguments} to call a function.\\n' }}"
    "{%- for t in tools %}{{- (t | tojson) + '\\n' }}{%- endfor %}{%- endif %}"
    "{{- sys + eos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role in ['user', 'assistant'] and not m.tool_calls %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + eos_token }}"
    "{%- elif m.role == 'assistant' %}{%- set f = m.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + '\", \"parameters\": '"
    " + (f.arguments | tojson) + '}' + eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (m.content | trim) + eos_token }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

FAMILIES = {"chatml": CHATML_TOOLS, "qwen3": QWEN3_TOOLS, "llama3": LLAMA3_TOOLS}

#: the tool call each family's model writes (what its template renders back, so history stays exact)
CALLS = {
    "chatml": '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>',
    "qwen3": '<think>\nI should look it up.\n</think>\n\n'
             '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>',
    "llama3": '{"name": "search", "parameters": {"query": "capital of France"}}',
}


class Recording:
    """Wraps a backend; ``calls`` holds every (prompt, sampled ids, log-probs) it produced."""

    def __init__(self, inner):
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.eos_ids = getattr(inner, "eos_ids", {inner.tokenizer.eos_token_id})
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def generate(self, prompts, params):
        gens = self.inner.generate(prompts, params)
        for p, g in zip(prompts, gens, strict=True):
            assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
            self.calls.append((list(p), list(g.token_ids), list(g.logprobs)))
        return gens


class ScriptedSampler:
    """A chat model that writes ``script[n]`` after ``n`` tool results (``Doc 1(`` in the prompt) and ends
    the turn with EOS; each token gets a distinct made-up log-probability, so a misplaced one is seen."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script = tokenizer, script
        self.eos_ids = {tokenizer.eos_token_id}
        self.n = 0

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.script[min(decode(self.tokenizer, p).count("Doc 1("), len(self.script) - 1)]
            ids = (encode(self.tokenizer, text) + [self.tokenizer.eos_token_id])[: params.max_new_tokens]
            lps = [-0.001 * (self.n + j + 1) for j in range(len(ids))]
            self.n += len(ids)
            out.append(Generation(ids, text, "stop", lps))
        return out

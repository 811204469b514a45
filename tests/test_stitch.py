"""The training proxy's records (agent.external.stitch), id by id, on a character-level tokenizer with a
plain chat template: a call continues its sequence only when its prompt starts with *all* of the previous
prompt and sampled ids (the last sampled token included), a continued conversation keeps the sampled ids
(history is never re-tokenised), a rewritten one is a split, and the stitched trajectories carry each token's
role, turn and log-probability. Tool-call parsing (Hermes and Llama 3.1 forms) and the turn's action too."""

from __future__ import annotations

import json

import pytest

from agent.external.stitch import (
    Call,
    EpisodeLog,
    chat_messages,
    encode_delta,
    parse_tool_calls,
    render_prompt,
    turn_action,
)
from agent.trajectory import Role


class ChatTokenizer:
    """One id per character; the chat template writes ``<role>content|`` per message and ``<assistant>`` as the
    generation prompt (``tools`` add a ``<tools:N>`` head). ``merge`` makes the two characters ``ab`` one id
    (999) when encoded together, as BPE merges across a boundary."""

    def __init__(self, merge: bool = False):
        self.merge, self.rendered = merge, []

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if self.merge and text.startswith("ab", i):
                ids.append(999)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join("ab" if i == 999 else chr(i) for i in ids)

    def apply_chat_template(self, messages, tools=None, chat_template=None, add_generation_prompt=False,
                            tokenize=False):
        assert tokenize is False and add_generation_prompt is True
        self.rendered.append((messages, tools, chat_template))
        head = f"<tools:{len(tools)}>" if tools else ""
        return head + "".join(f"<{m['role']}>{m['content']}|" for m in messages) + "<assistant>"


def ids(s):
    return [ord(c) for c in s]


# -- continuation ------------------------------------------------------------------------------------
def test_a_call_continues_only_when_it_keeps_every_previous_id_the_last_sampled_one_included():
    log = EpisodeLog("ep")
    assert log.context_ids == []
    assert log.add(Call([1, 2], [3, 4], None, "")) is False  # the first call starts the first sequence
    assert (log.splits, log.starts, log.context_ids) == (0, [0], [1, 2, 3, 4])
    assert log.add(Call([1, 2, 3, 9, 5], [6], None, "")) is False  # the last sampled id (4) changed: a split
    assert (log.splits, log.starts) == (1, [0, 1])
    assert log.add(Call([1, 2, 3, 9, 5, 6, 7], [8], None, "")) is True  # keeps all of [1, 2, 3, 9, 5] + [6]
    assert log.add(Call([1, 2, 3, 9, 5, 6, 7], [0], None, "")) is False  # drops the sampled 8: a split
    assert log.add(Call([2, 3, 9, 5, 6, 7, 0], [1], None, "")) is False  # drops the first id
    assert log.add(Call([2, 3, 9, 5, 6, 7, 0, 1], [], None, "")) is True  # exactly the context, nothing new
    assert (log.splits, log.starts) == (3, [0, 1, 3, 4])


def test_trajectories_of_a_continued_and_a_split_episode():
    log = EpisodeLog("ep")
    log.add(Call([1, 2], [3, 4], [-0.1, -0.2], "<search> q </search>", action="search", query="q"))
    log.add(Call([1, 2, 3, 4, 5, 6], [7], [-0.3], "Paris", action="answer"))
    log.add(Call([9, 9], [8], None, "again", action="answer"))  # a split: a new sequence
    a, b = log.trajectories("q0", "Q?", ["Paris"], group=3, answer="Paris")
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert a.roles == [Role.PROMPT, Role.PROMPT, Role.POLICY, Role.POLICY, Role.TOOL, Role.TOOL, Role.POLICY]
    assert a.turn_ids == [0, 0, 1, 1, 1, 1, 2]
    assert a.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert [(t.index, t.action, t.query, t.answer, t.n_policy_tokens, t.n_tool_tokens) for t in a.turns] == [
        (1, "search", "q", None, 2, 2), (2, "answer", None, "Paris", 1, 0)]
    assert a.metadata == {"episode": "ep", "segment": 0, "segments": 2}
    assert (a.question_id, a.question, a.golden_answers, a.group, a.answer) == ("q0", "Q?", ["Paris"], 3, "Paris")
    assert b.token_ids == [9, 9, 8] and b.roles == [Role.PROMPT, Role.PROMPT, Role.POLICY]
    assert b.turn_ids == [0, 0, 3] and b.logprobs is None  # no log-probs reported
    assert b.metadata == {"episode": "ep", "segment": 1, "segments": 2}
    assert [t.index for t in b.turns] == [3]
    a.check()
    b.check()


def test_logprobs_of_the_wrong_length_are_dropped_not_misaligned():
    log = EpisodeLog("ep")
    log.add(Call([1], [2, 3], [-0.5], "x"))
    (t,) = log.trajectories("q", "q")
    assert t.logprobs is None and t.roles == [Role.PROMPT, Role.POLICY, Role.POLICY]
    assert EpisodeLog("none").trajectories("q", "q") == []


# -- rendering ---------------------------------------------------------------------------------------
def test_a_continued_conversation_keeps_the_sampled_ids_and_tokenises_only_the_new_text():
    tok = ChatTokenizer(merge=True)
    msgs = [{"role": "user", "content": "hi"}]
    first, text = render_prompt(tok, None, msgs, None)
    assert text == "<user>hi|<assistant>" and first == ids(text)
    log = EpisodeLog("ep")
    sampled = [ord("a"), ord("b")]  # sampled as two ids; re-tokenised, "ab" would be one (999)
    log.add(Call(first, sampled, None, "ab", text=text, n_messages=1))
    msgs2 = msgs + [{"role": "assistant", "content": "ab"}, {"role": "tool", "content": "ab!"}]
    prompt, text2 = render_prompt(tok, log, msgs2, None)
    assert text2 == "<user>hi|<assistant>ab|<tool>ab!|<assistant>"
    # the previous prompt and sampled ids, then the new text: the tool's content tokenised on its own
    assert prompt == first + sampled + ids("|<tool>") + [999, ord("!")] + ids("|<assistant>")
    assert log.add(Call(prompt, [1], None, "", text=text2, n_messages=3)) is True


def test_a_rewritten_history_or_a_changed_last_token_is_rendered_whole():
    tok = ChatTokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    first, text = render_prompt(tok, None, msgs, None)
    log = EpisodeLog("ep")
    log.add(Call(first, ids("ok"), None, "ok", text=text, n_messages=1))
    # the agent sends back "oK": only the last sampled character differs
    changed = msgs + [{"role": "assistant", "content": "oK"}, {"role": "user", "content": "more"}]
    prompt, rendered = render_prompt(tok, log, changed, None)
    assert prompt == ids(rendered) and rendered == "<user>hi|<assistant>oK|<user>more|<assistant>"
    assert log.add(Call(prompt, [1], None, "", text=rendered, n_messages=3)) is False and log.splits == 1
    # a token-prompt call (no text) before: the chat call is rendered whole
    log2 = EpisodeLog("ep2")
    log2.add(Call(first, ids("ok"), None, "ok", text=None))
    same = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    prompt, rendered = render_prompt(tok, log2, same, None)
    assert prompt == ids(rendered)


def test_render_prompt_passes_tools_and_template():
    tok = ChatTokenizer()
    tools = [{"type": "function", "function": {"name": "search"}}]
    prompt, text = render_prompt(tok, None, [{"role": "user", "content": "x"}], tools, chat_template="T")
    assert text == "<tools:1><user>x|<assistant>" and prompt == ids(text)
    assert tok.rendered[-1][1:] == (tools, "T")
    render_prompt(tok, None, [{"role": "user", "content": "x"}], [])
    assert tok.rendered[-1][1] is None  # no tools: None, not []


def test_encode_delta_tokenises_each_content_apart_from_the_frame():
    tok = ChatTokenizer(merge=True)
    assert encode_delta(tok, "xaby", ["b"]) == [ord("x"), ord("a"), ord("b"), ord("y")]
    assert encode_delta(tok, "xaby", []) == [ord("x"), 999, ord("y")]
    assert encode_delta(tok, "ab", ["ab"]) == [999]
    assert encode_delta(tok, "x-ab-ab", ["ab", "ab"]) == [ord("x"), ord("-"), 999, ord("-"), 999]
    assert encode_delta(tok, "xaby", ["", "zz", "a"]) == [ord("x"), ord("a"), ord("b"), ord("y")]  # absent: skipped
    assert encode_delta(tok, "", []) == []
    # an empty content after a found one is skipped too, never a match at 0 that rewinds to the start
    assert encode_delta(tok, "xaby", ["b", ""]) == [ord("x"), ord("a"), ord("b"), ord("y")]


def test_chat_messages_shapes_openai_messages_for_templates():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}, "x"]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "function": {"name": "search", "arguments": '{"query": "q"}'}},
            {"id": "2", "function": {"name": "f", "arguments": "not json"}},
            {"id": "3", "function": {"name": "g", "arguments": {"k": 1}}}]},
        {"role": "tool", "content": "r", "tool_calls": []},
    ]
    out = chat_messages(msgs)
    assert out[0] == {"role": "user", "content": "ab"}
    assert out[1]["content"] == "" and [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [
        {"query": "q"}, "not json", {"k": 1}]
    assert out[2] == {"role": "tool", "content": "r", "tool_calls": []}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"query": "q"}'  # the input is not changed


# -- tool calls --------------------------------------------------------------------------------------
def _calls(calls):
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_tool_calls_hermes_and_llama():
    text = 'I will look.\n<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>' \
           '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    content, calls, err = parse_tool_calls(text)
    assert content == "I will look." and err is None
    assert _calls(calls) == [("function", "search", {"query": "q"}), ("function", "f", {"a": 1})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls) and calls[0]["id"] != calls[1]["id"]
    content, calls, err = parse_tool_calls(' {"name": "search", "parameters": {"query": "q"}} ')
    assert content == "" and err is None and _calls(calls) == [("function", "search", {"query": "q"})]
    assert _calls(parse_tool_calls('{"name": "g"}')[1]) == [("function", "g", {})]  # no arguments: {}
    for plain in ('{"name": "", "parameters": {}}', '{"name": 3}', '{"x": 1}', "{not json}", "[1]", "Paris", ""):
        assert parse_tool_calls(plain) == (plain, [], None), plain


@pytest.mark.parametrize("text,error", [
    ("<tool_call>{}", "unclosed <tool_call>"),
    ('<tool_call>{"name": "a"}</tool_call><tool_call>', "unclosed <tool_call>"),
    ("<tool_call>not json</tool_call>", "a tool call is not a JSON object with a name and object arguments"),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "a tool call is not a JSON object with a name and object arguments"),
    ('<tool_call>{"name": "a", "arguments": "[1"}</tool_call>', "a tool call is not a JSON object with a name and object arguments"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "a tool call is not a JSON object with a name and object arguments"),
])
def test_a_malformed_tool_call_is_plain_text_with_its_reason(text, error):
    assert parse_tool_calls(text) == (text, [], error)


def test_turn_action():
    call = {"function": {"name": "search", "arguments": '{"query": "q"}'}}
    other = {"function": {"name": "calc", "arguments": "{}"}}
    assert turn_action("x", [], "unclosed <tool_call>") == ("invalid", None)
    assert turn_action("Paris", [], None) == ("answer", None)
    assert turn_action("", [call], None) == ("search", "q")
    assert turn_action("", [call], None, search_tool="lookup") == ("tool", None)
    assert turn_action("", [call, call], None) == ("tool", None)
    assert turn_action("", [other], None) == ("tool", None)
    assert turn_action("", [{"function": {"name": "search", "arguments": '{"query": 3}'}}], None) == ("search", None)


def test_each_turn_of_a_continued_sequence_counts_its_own_tool_tokens():
    log = EpisodeLog("ep")
    log.add(Call([1, 2], [3], None, "a", action="search", query="q"))
    log.add(Call([1, 2, 3, 4], [5], None, "b", action="search", query="r"))  # one tool token after turn 1
    log.add(Call([1, 2, 3, 4, 5, 6, 7], [8], None, "c", action="answer"))  # two after turn 2
    (t,) = log.trajectories("q0", "Q?", ["x"])
    assert [(x.index, x.n_tool_tokens) for x in t.turns] == [(1, 1), (2, 2), (3, 0)]
    assert t.turn_ids == [0, 0, 1, 1, 2, 2, 2, 3]

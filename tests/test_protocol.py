"""The Search-R1 tag parser on well-formed and malformed turns."""

from agent.protocols.base import Action, format_docs
from agent.protocols.search_r1 import parse_action
from retrieval.base import Hit


def test_search_and_answer():
    assert parse_action("<think>need info</think>\n<search> capital of France </search>") == Action("search", "capital of France")
    assert parse_action("<answer> Paris </answer>") == Action("answer", "Paris")


def test_unclosed_tag_is_invalid():
    a = parse_action("<search> capital of France")
    assert a.kind == "invalid" and "unclosed <search>" in a.error
    assert parse_action("<answer> Paris").kind == "invalid"


def test_two_actions_in_one_turn_is_invalid():
    a = parse_action("<search> a </search><search> b </search>")
    assert a.kind == "invalid" and "two actions" in a.error
    a = parse_action("<search> a <answer> b </answer>")
    assert a.kind == "invalid" and "two actions" in a.error


def test_text_after_answer_is_reported_not_fatal():
    a = parse_action("<answer> Paris </answer> and some rambling")
    assert a.kind == "answer" and a.content == "Paris"
    assert a.trailing.strip() == "and some rambling" and not a.well_formed


def test_no_action_empty_action_and_stray_closer():
    assert parse_action("I think the answer is Paris").error == "no <search> or <answer> action"
    assert parse_action("<search>   </search>").error == "empty <search>"
    assert "without an opening tag" in parse_action("</answer> Paris").error


def test_oversized_query_is_invalid():
    a = parse_action("<search>" + "x" * 100_000 + "</search>", max_query_chars=2000)
    assert a.kind == "invalid" and "exceeds 2000" in a.error


def test_format_docs_matches_search_r1_rendering():
    hits = [Hit("1", "Paris", "Paris\nCapital of France.", 3.0), Hit("2", "Lyon", "Lyon\nA city.", 1.0)]
    assert format_docs(hits) == "Doc 1(Title: Paris) Capital of France.\nDoc 2(Title: Lyon) A city."


def test_function_call_stray_tool_call_closer_is_invalid_not_an_answer():
    # the turn stops at </tool_call>: a call written without its opening tag is a malformed call,
    # not a final answer made of JSON
    from agent.protocols import function_call

    a = function_call.parse_action('{"name": "search", "arguments": {"query": "x"}}</tool_call>')
    assert a.kind == "invalid" and "</tool_call> without <tool_call>" in a.error
    a = function_call.parse_action('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call></tool_call>')
    assert a.kind == "search" and a.content == "x"  # text after the call stays trailing text


def test_function_call_deeply_nested_json_is_an_invalid_action_not_an_exception():
    # valid-looking JSON nested past the decoder's recursion limit: a malformed call, told to the policy
    from agent.protocols import function_call

    for call in ("[" * 5000, '{"name": "search", "arguments": "' + "[" * 5000 + '"}'):
        a = function_call.parse_action("<tool_call>" + call + "</tool_call>")
        assert a.kind == "invalid" and "nested too deeply" in a.error


def test_function_call_unclosed_or_stray_answer_tag_is_invalid_not_part_of_the_answer():
    # "<answer> Paris" ended by EOS must not score "<answer> Paris" as the answer (EM 0 for a right answer)
    from agent.protocols import function_call

    a = function_call.parse_action("<answer> Paris")
    assert a.kind == "invalid" and "unclosed <answer>" in a.error
    a = function_call.parse_action("Paris </answer>")
    assert a.kind == "invalid" and "</answer> without <answer>" in a.error
    assert function_call.parse_action("The answer is Paris.") == Action("answer", "The answer is Paris.")
    assert function_call.parse_action("<answer> Paris </answer>") == Action("answer", "Paris")


def test_function_call_closed_answer_in_a_turn_cut_by_the_token_budget_is_the_answer():
    # "</answer>" is no stop string of function calling: a model that keeps talking after a closed answer until
    # max_new_tokens still answered (the error said "without a tool call or answer")
    from agent.protocols import function_call

    a = function_call.parse_action("<answer> Paris </answer> because the Eiffel Tower is", "length")
    assert a.kind == "answer" and a.content == "Paris" and not a.well_formed
    for cut in ("I think the answer is Par", "<answer> Par"):  # no whole answer: still invalid
        a = function_call.parse_action(cut, "length")
        assert a.kind == "invalid" and "token budget" in a.error

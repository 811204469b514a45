"""SSRL's self-search prompt, information mask and format / rule rewards (training.algos.ssrl)."""

import pytest

from training.algos import ssrl as S

T, ST = "<think> a </think>", "<think> b </think>"
SEARCH = "<search> who wrote it </search><information> Doc 1: it was written by X. </information>"
ANS = "<answer> X </answer>"


def test_options():
    o = S.ssrl_options()
    assert (o.em_weight, o.format_weight, o.max_turn, o.upper_bound, o.require_think) == (0.9, 0.1, 2, 8, True)
    with pytest.raises(ValueError, match="must be 1"):
        S.ssrl_options({"em_weight": 0.8})
    with pytest.raises(ValueError, match="max_turn <= upper_bound"):
        S.ssrl_options({"max_turn": 3, "upper_bound": 2})
    with pytest.raises(ValueError, match="did you mean 'max_turn'"):
        S.ssrl_options({"max_turns": 3})


def test_prompt_asks_the_policy_to_write_the_results():
    p = S.self_search_prompt("Who  wrote it?")
    assert "<information> and </information>" in p and "own knowledge" in p
    assert p.endswith("Question: Who wrote it?\n")
    assert S.self_search_prompt("Who?", short=True) == "Question: Who?\n"
    assert S.STOP_STRINGS == ("</answer>",)


@pytest.mark.parametrize("response, score", [
    (T + ANS, 0.5),  # one think, no search: min(1/2, 1) * 1
    (T + SEARCH + ST + ANS, 1.0),  # thinks = searches + 1 = 2
    (T + SEARCH + ANS, 0.25),  # one think for one search: 0.5 * min(1, 2) / max(1, 2)
    (T + SEARCH + ST + SEARCH + "<think> c </think>" + ANS, 1.0),
    ("  " + T + SEARCH + ST + ANS + "\n", 1.0),  # surrounding whitespace is stripped
    (T + "<search> q </search>" + ANS, 0.0),  # a search without its information
    (T + "<foo> x </foo>" + ANS, 0.0),  # another tag
    ("<think> </think>" + ANS, 0.0),  # an empty block
    (T + "<search> your query </search><information> d </information>" + ST + ANS, 0.0),  # a placeholder
    (T + "<search> a\nb </search><information> d </information>" + ST + ANS, 0.0),  # a multi-line query
    (SEARCH + T + ANS, 0.0),  # does not start with a think
    (T + SEARCH + ST, 0.0),  # does not end with an answer
    (T * 8 + ANS, 1 / 8),  # 8 thinks, no search: min(8/2, 1) * min(8, 1) / max(8, 1)
])
def test_format_score_cases(response, score):
    assert S.ssrl_format_score(response) == pytest.approx(score)


def test_format_score_upper_bound_both_sides():
    ok = T + "".join(SEARCH + T for _ in range(7)) + ANS  # 8 thinks, 7 searches
    assert S.ssrl_format_score(ok) == 1.0
    over = T + "".join(SEARCH + T for _ in range(8)) + ANS  # 9 thinks
    assert S.ssrl_format_score(over) == 0.0


def test_format_score_without_thinks_for_the_tiny_policy():
    o = S.ssrl_options({"require_think": False})
    assert S.ssrl_format_score(ANS, o) == 1.0
    assert S.ssrl_format_score(SEARCH + ANS, o) == 1.0
    assert S.ssrl_format_score("<search> q </search>" + ANS, o) == 0.0
    assert S.ssrl_format_score(ANS) == 0.0  # the paper's format needs the think


def test_reward_mixes_em_and_format():
    assert S.ssrl_reward(1.0, 0.5) == pytest.approx(0.95)
    assert S.ssrl_reward(0.0, 1.0) == pytest.approx(0.1)


def test_information_spans_and_token_mask():
    text = T + SEARCH + ANS
    s = text.index("<information>")
    e = text.index("</information>") + len("</information>")
    assert S.information_spans(text) == [(s, e)]
    assert S.information_spans("<information> open to the end") == [(0, 29)]
    tokens = ["<think>", " a ", "</think>", "<search>", " q ", "</search>", "<information>", " doc ",
              "</information>", "<answer>", " X ", "</answer>"]
    assert S.information_token_mask(tokens) == [False] * 6 + [True] * 3 + [False] * 3
    # a token that straddles the block's edge is masked too
    assert S.information_token_mask(["</search><infor", "mation> d </information><ans", "wer> X </answer>"]) == [
        True, True, False]


def test_split_at_search_for_sim_to_real():
    assert S.split_at_search(T + SEARCH + ANS) == (T + "<search> who wrote it </search>", "who wrote it")
    assert S.split_at_search(T + ANS) is None


def test_information_token_mask_with_a_real_tokenizer(tiny_policy_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    text = "<search> Paris </search><information> Paris is the capital of France. </information><answer> Paris </answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    token_texts = [p[len(pieces[i - 1]):] if i else p for i, p in enumerate(pieces)]
    assert "".join(token_texts) == tok.decode(ids)
    mask = S.information_token_mask(token_texts)
    inside = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    outside = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "capital of France" in inside and "capital" not in outside
    assert "<search> Paris </search>" in outside and "<answer> Paris </answer>" in outside

"""Metric edge cases (SQuAD normalisation as Search-R1 / FlashRAG), recall@k and aggregation."""

import unicodedata

import pytest

from eval.metrics import (
    aggregate,
    cover_exact_match,
    exact_match,
    f1_score,
    normalize_answer,
    recall_at_k,
    score_record,
)


# -- normalisation / EM --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pred, gold",
    [
        ("The Beatles", "Beatles"),  # leading article
        ("a dog", "the dog"),
        ("Beatles.", "beatles"),  # punctuation
        ("U.S.A.", "USA"),
        ("Greenwich Village,  New York City", "greenwich village new york city"),  # comma + whitespace
        ("  Paris \n", "paris"),
        ("ＰＡＲＩＳ", "paris"),  # full-width, NFKC
        ("Cafe\u0301", "Caf\u00e9"),  # decomposed vs composed accent, NFKC composes
        ("Yes", "yes"),
        ("1,000", "1000"),  # punctuation inside numbers is dropped
    ],
)
def test_em_equal_after_normalisation(pred, gold):
    assert exact_match(pred, [gold]) == 1.0


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("Malaga", "Málaga"),  # accents are NOT stripped (SQuAD script keeps them)
        ("theatre", "atre"),  # articles removed only as whole words
        ("anne", "ne"),
        ("yes", "no"),
        ("1000", "one thousand"),  # numbers are not spelled out
        ("3", "3.5"),  # "3.5" -> "35"
        ("New York", "New York City"),
        ("", "Paris"),
    ],
)
def test_em_not_equal(pred, gold):
    assert exact_match(pred, [gold]) == 0.0


def test_normalize_answer_known_values():
    assert normalize_answer("The  Quick, Brown-Fox!") == "quick brownfox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("ＡＢＣ１２３") == "abc123"
    assert normalize_answer("Ölü Deniz") == "ölü deniz"
    # NFKC of the decomposed and composed forms agree
    assert normalize_answer(unicodedata.normalize("NFD", "Málaga")) == normalize_answer("Málaga")


def test_multiple_golden_answers_take_the_max():
    golds = ["14 December 1972 UTC", "December 1972"]
    assert exact_match("december 1972", golds) == 1.0
    assert exact_match("1972", golds) == 0.0
    # F1 is the max over golds: vs "December 1972" p=1, r=1/2 -> 2/3
    assert f1_score("1972", golds) == pytest.approx(2 / 3)
    assert cover_exact_match("it was in December 1972.", golds) == 1.0


def test_none_prediction_scores_zero():
    assert exact_match(None, ["x"]) == 0.0
    assert f1_score(None, ["x"]) == 0.0
    assert cover_exact_match(None, ["x"]) == 0.0
    s = score_record({"id": "q", "prediction": None, "golden_answers": ["x"]})
    assert (s["em"], s["f1"], s["cover_em"], s["recall"]) == (0.0, 0.0, 0.0, None)


# -- F1 ------------------------------------------------------------------------------------------------
def test_f1_hand_computed():
    # pred tokens: [barack, obama, president], gold: [barack, obama]: p=2/3, r=1 -> 0.8
    assert f1_score("Barack Obama, the president", ["Barack Obama"]) == pytest.approx(0.8)
    # repeated tokens count with multiplicity: pred [new, new, york], gold [new, york]: common 2, p=2/3, r=1
    assert f1_score("new new york", ["New York"]) == pytest.approx(0.8)
    assert f1_score("Paris", ["London"]) == 0.0
    assert f1_score("", ["London"]) == 0.0


def test_f1_yes_no_must_match_exactly():
    # HotpotQA / SQuAD convention: a yes/no answer gets no partial credit
    assert f1_score("yes", ["yes"]) == 1.0
    assert f1_score("no", ["yes"]) == 0.0
    assert f1_score("yes it is", ["yes"]) == 0.0
    assert f1_score("yes", ["yes they are"]) == 0.0


def test_f1_numbers():
    assert f1_score("1,000 people", ["1000"]) == pytest.approx(2 / 3)
    assert f1_score("3.5", ["3"]) == 0.0


# -- cover-EM (Search-R1 subEM) ------------------------------------------------------------------------
def test_cover_em_is_substring_of_normalised_prediction():
    assert cover_exact_match("The answer is Paris, France.", ["paris"]) == 1.0
    assert cover_exact_match("Paris", ["Paris, France"]) == 0.0  # gold must be inside the prediction
    # plain substring, as Search-R1's subem_check and FlashRAG's Sub_ExactMatch
    assert cover_exact_match("19721", ["1972"]) == 1.0
    # a gold that normalises to "" never matches (it would match everything)
    assert cover_exact_match("anything", ["The", "  "]) == 0.0
    assert cover_exact_match("ＰＡＲＩＳ is the capital", ["Paris"]) == 1.0


def test_cover_em_is_at_least_em_when_the_gold_normalises_to_empty():
    # real golds that normalise to "": HotpotQA dev "The The" and "!!!", NQ test "A+", ")" and "---"
    for gold in ["The The", "!!!", "A+", ")", "---"]:
        assert exact_match(gold, [gold]) == 1.0
        assert cover_exact_match(gold, [gold]) == 1.0  # the exact answer also covers itself
    assert cover_exact_match("The The", ["The The", "Boy Hits Car"]) == 1.0
    assert cover_exact_match("the band The The", ["The The"]) == 0.0  # still no match for everything else


# -- recall@k ------------------------------------------------------------------------------------------
def test_recall_at_k():
    retrieved = ["d3", "d1", "d3", "d7", "d2"]
    assert recall_at_k(retrieved, ["d1", "d2"]) == 1.0
    assert recall_at_k(retrieved, ["d1", "d2"], k=2) == 0.5  # distinct top-2 = d3, d1
    assert recall_at_k(retrieved, ["d1", "d2"], k=3) == 0.5  # duplicate d3 does not take a slot: d3, d1, d7
    assert recall_at_k(retrieved, ["d1", "d2"], k=4) == 1.0
    assert recall_at_k([], ["d1"]) == 0.0
    assert recall_at_k(retrieved, []) is None
    assert recall_at_k(retrieved, None) is None
    with pytest.raises(ValueError):
        recall_at_k(retrieved, ["d1"], k=0)


# -- aggregation ---------------------------------------------------------------------------------------
def test_aggregate_means_and_hops():
    recs = [
        {"id": "a", "prediction": "Paris", "golden_answers": ["Paris"], "retrieved_ids": ["p1", "p2"],
         "supporting_ids": ["p1", "p9"], "hops": 2, "search_calls": 2, "turns": 3, "generated_tokens": 30, "wall_s": 1.0},
        {"id": "b", "prediction": "the city of Rome", "golden_answers": ["Rome"], "retrieved_ids": [],
         "supporting_ids": None, "hops": 3, "search_calls": 0, "turns": 1, "generated_tokens": 10, "wall_s": 3.0},
        {"id": "c", "prediction": None, "golden_answers": ["x"], "retrieved_ids": ["p1"],
         "supporting_ids": ["p1"], "hops": 2, "search_calls": 1, "turns": 2, "generated_tokens": 20, "wall_s": 2.0},
    ]
    agg = aggregate(recs, recall_k=(1,))
    assert agg["n"] == 3
    assert agg["em"] == pytest.approx(1 / 3)
    assert agg["cover_em"] == pytest.approx(2 / 3)
    assert agg["f1"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)  # "city of rome" vs "rome": p=1/3, r=1 -> 0.5
    assert agg["recall"] == pytest.approx((0.5 + 1.0) / 2) and agg["n_recall"] == 2
    assert agg["recall@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert agg["search_calls"] == 1.0 and agg["turns"] == 2.0
    assert agg["generated_tokens"] == 20.0 and agg["wall_s"] == 2.0
    assert agg["by_hops"] == {
        "2": {"n": 2, "em": 0.5, "f1": 0.5, "cover_em": 0.5},
        "3": {"n": 1, "em": 0.0, "f1": 0.5, "cover_em": 1.0},
    }


def test_aggregate_empty_and_missing_fields():
    agg = aggregate([])
    assert agg["n"] == 0 and agg["em"] is None and agg["recall"] is None and agg["by_hops"] == {}
    with pytest.raises(KeyError, match="golden_answers"):
        aggregate([{"id": "q", "prediction": "x"}])

"""The method options helper (training.algos.options): unknown names and ranges give clear errors."""

from dataclasses import dataclass

import pytest

from training.algos.options import check_range, parse_options


@dataclass(frozen=True)
class Opts:
    alpha: float = 0.3
    steps: int = 2


def test_parse_options_defaults_and_values():
    assert parse_options(Opts, None, "X") == Opts()
    assert parse_options(Opts, {"alpha": 0.5}, "X") == Opts(alpha=0.5)


def test_parse_options_names_the_unknown_option_and_the_closest_one():
    with pytest.raises(ValueError, match=r"unknown X option\(s\) 'alpah'; X takes alpha, steps \('alpah': did you mean 'alpha'\?\)"):
        parse_options(Opts, {"alpah": 1.0}, "X")
    with pytest.raises(ValueError, match=r"'zzz'; X takes alpha, steps$"):
        parse_options(Opts, {"zzz": 1}, "X")


def test_check_range_both_sides_of_each_bound():
    check_range("a", 0.0, 0.0, 1.0)
    check_range("a", 1.0, 0.0, 1.0)
    check_range("a", 5.0, 0.0)
    with pytest.raises(ValueError, match=r"a must lie in \(0.0, 1.0\], got 0.0"):
        check_range("a", 0.0, 0.0, 1.0, lo_open=True)
    with pytest.raises(ValueError, match=r"\[0.0, 1.0\), got 1.0"):
        check_range("a", 1.0, 0.0, 1.0, hi_open=True)
    with pytest.raises(ValueError, match=r"\[0.0, inf\), got -1"):
        check_range("a", -1, 0.0)
    with pytest.raises(ValueError, match="got nan"):
        check_range("a", float("nan"), 0.0, 1.0)

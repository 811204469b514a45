"""bench/mutation.py's plumbing on a two-function project of its own (a real cosmic-ray session, a handful of
mutants, a few seconds): the operator filter, the definition filter, the forking test server, the counts and
the survivors it reports, and its table. The campaign over the core modules is the benchmark itself."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "mutation.py"


@pytest.fixture(scope="module")
def mut():
    spec = importlib.util.spec_from_file_location("bench_mutation", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


TINY = '''\
def at_least(x, lo):
    if x >= lo:
        return x
    return lo


def untested(x):
    return x + 1
'''

TEST = '''\
from tiny import at_least


def test_at_least():
    assert at_least(3, 2) == 3
    assert at_least(1, 2) == 2
'''


def test_keep_operator(mut):
    keep = mut.keep_operator
    assert keep("core/ReplaceBinaryOperator_Add_Sub") and keep("core/ReplaceBinaryOperator_Mul_FloorDiv")
    assert keep("core/ReplaceBinaryOperator_BitAnd_BitOr") and keep("core/ReplaceBinaryOperator_Mod_Add")
    assert not keep("core/ReplaceBinaryOperator_Add_LShift") and not keep("core/ReplaceBinaryOperator_BitOr_Add")
    assert not keep("core/ReplaceBinaryOperator_Add_Pow")
    assert keep("core/ReplaceComparisonOperator_Lt_LtE") and keep("core/ReplaceComparisonOperator_Is_IsNot")
    assert not keep("core/ReplaceComparisonOperator_Eq_Is") and not keep("core/ReplaceComparisonOperator_Is_Eq")
    assert keep("core/NumberReplacer") and keep("core/AddNot") and keep("core/ZeroIterationForLoop")
    assert not keep("core/VariableReplacer") and not keep("core/VariableInserter")


def test_definition_lines(mut, tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import x\n\n\n@dec\ndef f():\n    return 1\n\n\nclass C:\n    def g(self):\n        return 2\n")
    assert mut.definition_lines(src, ("f",)) == {4, 5, 6}
    assert mut.definition_lines(src, ("C.g",)) == {10, 11}
    assert mut.definition_lines(src, ("C",)) == {9, 10, 11}
    with pytest.raises(ValueError, match=r"no definition named \['h', 'C.h'\]; update TARGETS"):
        mut.definition_lines(src, ("f", "h", "C.h"))


def test_annotation_spans_only_where_annotations_are_never_evaluated(mut, tmp_path):
    src = tmp_path / "m.py"
    body = "def f(x: int | None, *a: str) -> bool | None:\n    y: list[int] = []\n    return x | 1\n"
    src.write_text("from __future__ import annotations\n\n" + body)
    assert mut.annotation_spans(src) == [((3, 9), (3, 19)), ((3, 25), (3, 28)), ((3, 33), (3, 44)),
                                         ((4, 7), (4, 16))]
    src.write_text(body)  # evaluated annotations: mutants there are real
    assert mut.annotation_spans(src) == []


def test_every_target_names_existing_files_and_definitions(mut):
    root = BENCH.parents[1]
    for name, t in mut.TARGETS.items():
        assert (root / t.path).is_file(), name
        assert t.tests and all((root / x).is_file() for x in t.tests), name
        if t.only:
            assert mut.definition_lines(root / t.path, t.only), name


def test_a_small_campaign_counts_kills_and_names_the_survivor(mut, tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "test_tiny.py").write_text(TEST)
    target = mut.Target("tiny.py", ("test_tiny.py",), only=("at_least",))
    work = tmp_path / "work"
    work.mkdir()
    r = mut.run_target("tiny", target, tmp_path, work, preload=False)
    # `x >= lo`: == != < <= > (5) and AddNot on the `if` (1); `untested` is outside `only`
    assert (r["mutants"], r["killed"], r["survived"], r["timeout"], r["errors"], r["pending"]) == (6, 5, 1, 0, 0, 0)
    (s,) = r["survivors"]  # x > lo returns lo when x == lo: the same value, an equivalent mutant
    assert (s["line"], s["operator"], s["source"]) == (2, "ReplaceComparisonOperator_GtE_Gt", "if x >= lo:")
    assert "-    if x >= lo:" in s["diff"] and "+    if x > lo:" in s["diff"]
    assert r["surviving_share"] == round(1 / 6, 4) and (tmp_path / "tiny.py").read_text() == TINY  # restored
    assert mut.table({"tiny": r}).splitlines()[-1] == "| tiny | `tiny.py` | 6 | 5 | 1 | 0 | 0 | 16.7% |"
    json.dumps(r)
    again = mut.run_target("tiny", target, tmp_path, work, preload=False, previous=r)  # its survivor alone
    assert (again["mutants"], again["killed"], again["survived"], again["survivors_rerun"]) == (6, 5, 1, True)
    assert again["survivors"] == r["survivors"] and again["surviving_share"] == r["surviving_share"]
    assert again["killed_since"] == []
    # a survivor the tests kill now (as if `x >= lo -> x == lo` had survived before) moves to killed_since
    eq = {"line": 2, "operator": "ReplaceComparisonOperator_GtE_Eq", "occurrence": 0, "source": "", "diff": ""}
    before = {**r, "killed": 4, "survived": 2, "survivors": [*r["survivors"], eq]}
    again = mut.run_target("tiny", target, tmp_path, work, preload=False, previous=before)
    assert (again["mutants"], again["killed"], again["survived"]) == (6, 5, 1) and again["killed_since"] == [eq]
    with pytest.raises(ValueError, match="changed since its last run"):
        mut.run_target("tiny", target, tmp_path, work, preload=False, previous={**r, "source_sha256": "0" * 64})
    dry = mut.run_target("tiny", mut.Target("tiny.py", ("test_tiny.py",)), tmp_path, work, dry_run=True, preload=False)
    assert dry["mutants"] == dry["pending"] > 6 and dry["killed"] == dry["survived"] == 0  # the whole file
    whole = dry["mutants"]
    dry = mut.run_target("tiny", mut.Target("tiny.py", ("test_tiny.py",)), tmp_path, work, dry_run=True, preload=False,
                         sample=3)  # every k-th mutant, at most 3
    assert dry["mutants"] == dry["pending"] == 3 and dry["unsampled"] == whole - 3
    assert f"| 3 (sample of {whole}) |" in mut.table({"tiny": dry})


def test_results_merge_per_module(mut, tmp_path):
    out = tmp_path / "r" / "mutation.json"
    mut.write_results(out, {"a": {"mutants": 1}, "b": {"mutants": 2}})
    mut.write_results(out, {"b": {"mutants": 3}})  # a rerun of one module keeps the others
    got = json.loads(out.read_text())
    assert got["modules"] == {"a": {"mutants": 1}, "b": {"mutants": 3}} and got["tool"].startswith("cosmic-ray ")


def test_unknown_modules_are_refused(mut):
    with pytest.raises(SystemExit):
        mut.main(["no_such_module"])

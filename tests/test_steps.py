"""One step module per notebook, one shape: begin → the notebook's calls → verdict() → finish()."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pandas as pd
import pytest

from dsr1kit import steps
from dsr1kit.cluster import checks
from dsr1kit.infer import results
from dsr1kit.steps import cluster_check, vllm_inference

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _code(notebook: Path) -> list[str]:
    nb = json.loads(notebook.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _step_name(notebook: Path) -> str:
    return notebook.stem.split("_", 1)[1]  # 20_hari_training -> hari_training


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_is_backed_by_its_step_module(notebook):
    name = _step_name(notebook)
    module = importlib.import_module(f"dsr1kit.steps.{name}")
    assert callable(getattr(module, "verdict", None)), f"dsr1kit.steps.{name} has no verdict()"
    cells = _code(notebook)
    imports = [n for n in ast.walk(ast.parse(cells[1])) if isinstance(n, ast.ImportFrom)]
    assert any(n.module == "dsr1kit.steps" and [a.name for a in n.names] == [name] for n in imports), cells[1]
    assert "steps.begin(params." in cells[1]
    last = cells[-1]
    assert f"verdict = {name}.verdict(" in last and "steps.record(run_dir, verdict" in last
    assert last.rstrip().splitlines()[-1].startswith("steps.finish(verdict)")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_cells_define_no_functions_or_classes(notebook):
    """Logic lives in dsr1kit where a test reaches it; a cell only calls, tables and plots."""
    for source in _code(notebook):
        tree = ast.parse(source)
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]


def test_finish_fails_the_run_only_on_fail_with_the_steps_error():
    steps.finish(steps.Verdict("ok", "fine"))
    steps.finish(steps.Verdict("warn", "preempted", ["requeue"]))
    with pytest.raises(cluster_check.ChecksFailed, match=r"1 fail .*FAIL shm"):
        steps.finish(
            steps.Verdict(
                "fail",
                "1 fail of 1 checks",
                ["FAIL shm on n1: 0.1 GiB → free it"],
                cluster_check.ChecksFailed,
            )
        )


def test_cluster_check_verdict_names_each_failing_check_and_its_fix():
    rows = [
        checks.Row("python", checks.PASS, "3.11"),
        checks.Row(
            "/dev/shm free",
            checks.FAIL,
            "0.1 GiB",
            ">= 32 GiB",
            "ask for a node with a larger /dev/shm",
            "n1",
        ),
        checks.Row("scratch dir", checks.WARN, "5 GiB", ">= 500 GiB", "", "n1"),
    ]
    v = cluster_check.verdict(rows)
    assert (v.status, v.headline) == ("fail", "1 pass, 1 warn, 1 fail of 3 checks")
    assert v.lines[0] == "FAIL /dev/shm free on n1: 0.1 GiB → ask for a node with a larger /dev/shm"
    assert (
        cluster_check.verdict(rows[:1]).status == "ok" and cluster_check.verdict(rows[::2]).status == "warn"
    )


class _Parity:
    def __init__(self, verdict, status):
        self.verdict, self.status = verdict, status

    def lines(self):
        return [f"parity: {self.verdict}"]


def test_inference_verdict_fails_an_adapter_that_changes_nothing():
    table = pd.DataFrame(
        [
            {
                "category": "all",
                "accuracy": 0.5,
                "ci95_low": 0.3,
                "ci95_high": 0.7,
                "correct": 8,
                "scored_on": "16 of 16",
            }
        ]
    )
    tables = {"base": table, "adapter": table}
    assert vllm_inference.verdict(vllm_inference.EvalResult(tables)).status == "ok"
    assert (
        vllm_inference.verdict(vllm_inference.EvalResult(tables)).headline
        == "base 50.0% (scored on 16 of 16); adapter 50.0% (scored on 16 of 16)"
    )
    assert (
        vllm_inference.verdict(vllm_inference.EvalResult(tables, _Parity("applied", "pass"))).status == "ok"
    )
    assert (
        vllm_inference.verdict(vllm_inference.EvalResult(tables, _Parity("inconclusive", "warn"))).status
        == "warn"
    )
    none = vllm_inference.verdict(vllm_inference.EvalResult(tables, _Parity("no-effect", "fail")))
    assert none.status == "fail" and "parity: no-effect" in none.lines
    with pytest.raises(vllm_inference.AdapterHasNoEffect):
        steps.finish(none)


def test_inference_verdict_shows_each_sets_gain_and_cost():
    def table(a, b):
        return pd.DataFrame(
            [
                {
                    "category": c,
                    "accuracy": x,
                    "ci95_low": 0.0,
                    "ci95_high": 1.0,
                    "correct": 0,
                    "scored_on": "20 of 20",
                }
                for c, x in (("all", (a + b) / 2), ("task A", a), ("task B", b))
            ]
        )

    v = vllm_inference.verdict(
        vllm_inference.EvalResult({"base": table(0.9, 0.05), "adapter": table(0.6, 0.8)})
    )
    assert "task A: base 90.0% → adapter 60.0% (-30.0 points, scored on 20 of 20)" in v.lines
    assert "task B: base 5.0% → adapter 80.0% (+75.0 points, scored on 20 of 20)" in v.lines
    assert results.category_changes({"base": table(0.9, 0.05)}) == []


def test_several_eval_sets_are_read_per_set_and_ids_must_not_clash(tmp_path):
    from dsr1kit.infer import evaluate

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        "".join(json.dumps({"id": f"a{i}", "question": "q", "answer": "x"}) + "\n" for i in range(5))
    )
    b.write_text(
        "".join(json.dumps({"id": f"b{i}", "question": "q", "answer": "y"}) + "\n" for i in range(3))
    )
    items = evaluate.load_items(f"{a}, {b}", limit=2).items
    assert [i.id for i in items] == ["a0", "a1", "b0", "b1"]  # the limit is per set
    assert [i.source for i in items] == [str(a)] * 2 + [str(b)] * 2
    assert evaluate.load_items(f"{a},{b}").asked == 8
    with pytest.raises(ValueError, match="'a0' is in both"):
        evaluate.load_items(f"{a},{a}")

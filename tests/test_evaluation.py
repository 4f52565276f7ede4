"""The evaluation harness: metrics on hand-made cases, the tasks' data, and the harness end to end on tiny models
(with the identity translator, every translated condition must score exactly what native reading scores)."""

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import char_tokenizer, identity_translator, tiny_model

from hf_mot.evaluation.metrics import answer_found, choice_correct, exact_match, normalize_answer, token_f1
from hf_mot.evaluation.report import machine_info, markdown_report, run_evaluation, write_report
from hf_mot.evaluation.tasks import (
    boolq_examples,
    long_context_examples,
    quac_examples,
    synthetic_document,
    synthetic_qa_examples,
)
from hf_mot.files import write_json_atomically


def test_normalize_and_exact_match():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert exact_match("the Paris.", ["Paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0


@pytest.mark.parametrize(
    "prediction, answers, f1",
    [
        ("Gustave Eiffel", ["Gustave Eiffel"], 1.0),
        ("Eiffel", ["Gustave Eiffel"], 2 / 3),  # precision 1, recall 1/2
        ("the company of Gustave Eiffel", ["Gustave Eiffel"], 2 / 3),  # "the" dropped: 2 of 4 predicted, 2 of 2 gold
        ("London", ["Gustave Eiffel", "Paris"], 0.0),
        ("Paris", ["Gustave Eiffel", "Paris"], 1.0),  # best over the answers
        ("", ["Paris"], 0.0),
    ],
)
def test_token_f1(prediction, answers, f1):
    assert token_f1(prediction, answers) == pytest.approx(f1)


@pytest.mark.parametrize(
    "prediction, answers, found",
    [
        ("He works as a ferry captain.", ["ferry captain"], 1.0),  # F1 0.57: the fact, phrased otherwise
        ("Ferry", ["ferry captain"], 0.0),  # part of the answer is not the answer
        ("She retired in 2012.", ["12"], 0.0),  # whole words: "12" is not in "2012"
        ("In 1912, in Paris", ["Lyon", "1912"], 1.0),  # any of the answers
        ("The Eiffel-Tower", ["Eiffel Tower"], 0.0),  # normalised as F1 normalises: "eiffeltower"
        ("nothing", [""], 0.0),  # an empty answer is found nowhere
    ],
)
def test_answer_found(prediction, answers, found):
    assert answer_found(prediction, answers) == found


def test_choice_correct():
    assert choice_correct([-0.1, -2.0], 0) == 1.0
    assert choice_correct([-0.1, -2.0], 1) == 0.0
    assert choice_correct([-1.0, -1.0], 0) == 0.0  # a tie is not a win


def test_tasks_read_their_data():
    boolq = boolq_examples(20)
    assert len(boolq) == 20 and all(e.answers[0] in (" yes", " no") and e.choices == [" yes", " no"] for e in boolq)
    assert {e.answers[0] for e in boolq} == {" yes", " no"}
    quac = quac_examples(10)
    assert len(quac) == 10 and all(e.answers[0] and "CANNOTANSWER" not in e.answers[0] for e in quac)
    for example in synthetic_qa_examples(20, seed=3):
        assert example.answers[0] in example.context
    assert synthetic_qa_examples(5, seed=1)[0].context == synthetic_qa_examples(5, seed=1)[0].context
    document, qa = synthetic_document(__import__("random").Random(0))
    assert len(qa) == 16 and all(answer in document for _, answer in qa)


def test_long_context_lengths_and_depths(gemma3):
    _, tokenizer = gemma3
    examples = long_context_examples(tokenizer, lengths=(512, 2048), depths=(0.1, 0.9), per_cell=1)
    cells = [(e.meta["length"], e.meta["depth"]) for e in examples]
    assert cells == [(512, 0.1), (512, 0.9), (2048, 0.1), (2048, 0.9)]
    for example in examples:
        tokens = len(tokenizer(example.context).input_ids)
        assert abs(tokens - example.meta["length"]) <= 0.02 * example.meta["length"] + 4
        where = example.context.find(example.answers[0]) / len(example.context)
        assert abs(where - example.meta["depth"]) < 0.15


def test_harness_end_to_end_with_the_identity_oracle(tmp_path):
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    model.config.max_position_embeddings = 4096  # BoolQ passages are long in characters; RoPE has no limit
    translator = identity_translator(model, tokenizer).eval()
    report = run_evaluation(
        translator=translator, source_model=model, source_tokenizer=tokenizer, target_model=model,
        target_tokenizer=tokenizer, tasks=("boolq", "synthetic", "long_context", "reuse"), limit=8,
        lengths=(96, 192), recompute=(0.5,), native_tail=4, progress=False,
    )
    assert report["conditions"] == ["full", "recompute=0.5", "full+tail4"]
    results = report["results"]
    for task in ("boolq", "synthetic", "long_context"):
        rows = results[task]["rows"]
        assert rows
        for row in rows:
            for condition in report["conditions"]:
                assert row[condition]["score"] == row["native"]["score"]
                assert row[condition].get("prediction") == row["native"].get("prediction")
                if "log_probs" in row["native"]:
                    assert row[condition]["log_probs"] == pytest.approx(row["native"]["log_probs"], abs=1e-4)
    reuse = results["reuse"]["summary"]
    assert reuse["translated"]["f1"] == reuse["reread"]["f1"]
    assert reuse["translated"]["cache_mb"] == pytest.approx(reuse["reread"]["cache_mb"])

    paths = write_report(report, tmp_path / "out", "hf-mot evaluate (test)",
                         {"source": "tiny", "target": "tiny", "translator": "identity"})
    written = json.loads(paths["json"].read_text())
    assert written["results"]["boolq"]["summary"]["examples"] == 8
    assert set(written["splits"]) == {"boolq", "synthetic", "long_context", "reuse"}
    table = paths["markdown"].read_text()
    assert "| boolq | accuracy | 8 |" in table and "retention (full+tail4)" in table and "Multi-agent reuse" in table
    assert paths["plot"].stat().st_size > 0
    assert markdown_report(report) in table


def test_report_json_names_the_machine_and_is_never_half_written(tmp_path):
    machine = machine_info(threads=3)
    assert machine["cpu"] and machine["threads"] == 3 and machine["torch"] and machine["transformers"]
    path = tmp_path / "new" / "report.json"
    write_json_atomically(path, {"machine": machine, "gap": 0.5})
    assert json.loads(path.read_text())["gap"] == 0.5
    with pytest.raises(TypeError):  # not serialisable: the previous report must survive whole
        write_json_atomically(path, {"gap": object()})
    assert json.loads(path.read_text()) == {"machine": machine, "gap": 0.5}
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def _quality_dial():
    """benchmarks/quality_dial.py as a module (benchmarks/ is not a package)."""
    path = Path(__file__).parents[1] / "benchmarks" / "quality_dial.py"
    spec = importlib.util.spec_from_file_location("quality_dial", path)
    dial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dial)
    return dial


def test_quality_dial_pairs_settings_over_the_same_contexts():
    dial = _quality_dial()
    # Ten contexts of one question: the dial point answers the first six, its control the first two, pure
    # translation the first four and a compared translator the last five.
    rows = [{"task": "needle" if i < 5 else "synthetic", "native": [1.0], "no_context": [0.0],
             "recompute=0": {"scores": [float(i < 4)]}, "recompute=0.2": {"scores": [float(i < 6)]},
             "control 0.2": {"scores": [float(i < 2)]}, "other": {"scores": [float(i >= 5)]},
             "deviation 0.2": {"scores": [float(i < 3)]}} for i in range(10)]
    out = dial.paired(rows, [0, 0.2], ("other",), others=(("deviation", 0.2), ("deviation", 0.5)))["all"]
    assert out["recompute=0.2 - control 0.2"]["difference"] == pytest.approx(0.4)
    assert (out["recompute=0.2 - control 0.2"]["higher"], out["recompute=0.2 - control 0.2"]["lower"]) == (4, 0)
    low, high = out["recompute=0.2 - control 0.2"]["interval"]
    assert 0 < low <= 0.4 <= high < 1
    assert out["recompute=0.2 - recompute=0"]["difference"] == pytest.approx(0.2)
    other = out["recompute=0 - other"]
    assert other["difference"] == pytest.approx(-0.1) and (other["higher"], other["lower"]) == (4, 5)
    # Another strategy against the tail at its own budget; a budget the tail was not measured at pairs with nothing.
    strategy = out["deviation 0.2 - recompute=0.2"]
    assert strategy["difference"] == pytest.approx(-0.3) and (strategy["higher"], strategy["lower"]) == (0, 3)
    assert not any("0.5" in name for name in out)


def test_quality_dial_reports_answers_found_per_context():
    """`answer found` averages each context's share of replies containing an answer, as retention averages scores:
    a document of eight questions counts once, not eight times."""
    dial = _quality_dial()
    rows = [{"task": "reuse", "native": [1.0] * 8, "native_found": [1.0] * 8, "no_context": [0.0] * 8,
             "recompute=0": {"scores": [0.5] * 8, "found": [1.0] * 8, "seconds": 1.0}},
            {"task": "needle", "native": [1.0], "native_found": [0.0], "no_context": [0.0],
             "recompute=0": {"scores": [0.0], "found": [0.0], "seconds": 1.0}}]
    for row in rows:
        row.update(context_tokens=100, native_seconds=2.0, source_seconds=1.0)
    summary = dial.summarize(rows, [0], resamples=20)
    assert summary["all"]["recompute=0"]["found"] == pytest.approx(0.5)
    assert summary["all"]["native_found"] == pytest.approx(0.5)
    assert "found" not in summary["all"]["no_context"]
    line = next(x for x in dial.table(summary, [0]).splitlines() if x.startswith("| all |") and "recompute=0" in x)
    assert "| 50% (50%) |" in line

"""`popbert export --eval FILE [--max-accuracy-drop POINTS]`: the accuracy cost of a cheaper
export, measured on the user's data against the plain FP32 export, and the refusal.

The negative control perturbs the quantized classifier's bias just enough to flip about half the
labels of a random model (whose logits lie close together) while staying inside the INT8 export
check, so the refusal is exercised by the real scoring path, not by a stub.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from checkpoint_helpers import random_task_run

from popbert.cli import main as cli
from popbert.config import TaskConfig, load_config
from popbert.data.tokenization import bundled_vocab_path
from popbert.export import inference as export
from popbert.export.accuracy import AccuracyCost, AccuracyError, accuracy_cost, check_drop
from popbert.serve.predict import ClassifyPredictor, read_texts

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]
WORDS = "the film was long and far too slow good bad fine an pleasant afternoon cinema".split()
FIXTURE = Path(__file__).parent.parent / "fixtures" / "squad" / "squad-v1.1-sample.json"


@dataclasses.dataclass
class Setup:
    run: Path  # a random classification run directory
    reference: Path  # its plain FP32 export
    rows: Path  # labelled with the reference's own predictions: its accuracy is 100
    texts: Path  # the same texts, unlabelled
    margin: float  # median logit(pos) - logit(neg) of the reference over the rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """A random model's logits lie close together (margins within a few 0.01 of each other),
    so moving the "pos" bias by the median margin flips about half of the labels."""
    directory = tmp_path_factory.mktemp("guard")
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TaskConfig(name="classification", lowercase=True, num_labels=2,
                                labels=["neg", "pos"])
    cfg.data.vocab_file = str(bundled_vocab_path())
    random_task_run(directory / "run", cfg, "classification", seed=5)
    reference = export.export_checkpoint(directory / "run", "classification",
                                         directory / "fp32.onnx")
    texts = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 18))
             for i in range(60)]
    (directory / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    probabilities = ClassifyPredictor(reference).probabilities(
        read_texts(directory / "texts.txt"))
    labels = ["pos" if p[1] > p[0] else "neg" for p in probabilities]
    (directory / "rows.tsv").write_text("sentence\tlabel\n" + "".join(
        f"{t}\t{label}\n" for t, label in zip(texts, labels)), encoding="utf-8")
    margin = float(np.median(np.log(probabilities[:, 1] / probabilities[:, 0])))
    return Setup(directory / "run", reference, directory / "rows.tsv", directory / "texts.txt",
                 margin)


def shift_pos_bias(model: onnx.ModelProto, shift: float) -> onnx.ModelProto:
    for tensor in model.graph.initializer:
        if tensor.name == "Classifier/B":
            bias = onnx.numpy_helper.to_array(tensor).copy()
            bias[1] += shift
            tensor.CopyFrom(onnx.numpy_helper.from_array(bias, tensor.name))
    return model


def test_int8_export_reports_its_accuracy_cost(setup: Setup, tmp_path: Path, caplog) -> None:
    output = tmp_path / "int8.onnx"
    with caplog.at_level(logging.INFO):
        assert cli.main(["export", "--checkpoint", str(setup.run), "--task",
                         "classification", "--output", str(output), "--optimize",
                         "--quantize", "int8", "--eval", str(setup.rows),
                         "--max-accuracy-drop", "100"]) == 0
    line = next(r.getMessage() for r in caplog.records if "accuracy cost" in r.getMessage())
    assert "on 60 examples" in line and "agreement with FP32" in line and "accuracy" in line
    assert output.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["int8.onnx"]


def test_a_half_precision_export_reports_its_cost_too(setup: Setup, tmp_path: Path,
                                                      caplog) -> None:
    output = tmp_path / "fp16.onnx"
    with caplog.at_level(logging.INFO):
        assert cli.main(["export", "--checkpoint", str(setup.run), "--task", "classification",
                         "--output", str(output), "--dtype", "float16", "--eval",
                         str(setup.texts)]) == 0
    line = next(r.getMessage() for r in caplog.records if "accuracy cost" in r.getMessage())
    assert "on 60 examples" in line and output.is_file()


def test_the_cost_is_measured_not_assumed(setup: Setup, tmp_path: Path) -> None:
    """The FP32 export against itself costs nothing; a perturbed one costs what it changed."""
    same = accuracy_cost(setup.reference, setup.reference, "classification", setup.rows)
    assert (same.examples, same.agreement, same.drop) == (60, 1.0, 0.0)
    assert same.reference == same.candidate and same.reference["accuracy"] == 100.0
    flipped = tmp_path / "flipped.onnx"
    onnx.save(shift_pos_bias(onnx.load(str(setup.reference)), -setup.margin), str(flipped))
    labelled = accuracy_cost(setup.reference, flipped, "classification", setup.rows)
    assert labelled.metric == "accuracy" and 0.2 < labelled.agreement < 0.8
    assert labelled.drop == pytest.approx(100 * (1 - labelled.agreement))
    unlabelled = accuracy_cost(setup.reference, flipped, "classification", setup.texts)
    assert unlabelled.metric == "changed" and unlabelled.reference == {}
    assert unlabelled.drop == pytest.approx(labelled.drop)


def test_a_drop_over_the_threshold_writes_nothing(setup: Setup, tmp_path: Path, monkeypatch,
                                                  capsys) -> None:
    """Negative control: the quantized classifier with its "pos" bias moved by the median
    margin changes labels (inside the INT8 numeric check, which allows 0.5 of the logits'
    scale), so --max-accuracy-drop 1 must refuse it in one line and write nothing."""
    real = export.quantize_int8

    def nudged(model, keep_float, per_channel=True):
        model, counts = real(model, keep_float, per_channel)
        return shift_pos_bias(model, -setup.margin), counts

    monkeypatch.setattr(export, "quantize_int8", nudged)
    output = tmp_path / "out" / "int8.onnx"
    code = cli.main(["export", "--checkpoint", str(setup.run), "--task", "classification",
                     "--output", str(output), "--quantize", "int8", "--eval", str(setup.rows),
                     "--max-accuracy-drop", "1"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("popbert: error:")]
    assert code == 2 and len(errors) == 1 and "--max-accuracy-drop 1" in errors[0], err
    assert "not written" in errors[0] and "points of accuracy" in errors[0]
    assert "Traceback" not in err
    assert not output.exists() and list(output.parent.iterdir()) == []


def test_squad_export_cost_uses_the_official_metric(tmp_path: Path) -> None:
    cfg = load_config("tiny", [*SMALL[:-1], "model.max_predictions_per_seq=5"])
    cfg.model.task = TaskConfig(name="squad", lowercase=True, doc_stride=8, max_query_length=12)
    cfg.data.vocab_file = str(bundled_vocab_path())
    random_task_run(tmp_path / "run", cfg, "squad", seed=4)
    output = tmp_path / "squad-int8.onnx"
    path = export.export_checkpoint(tmp_path / "run", "squad", output, quantize="int8",
                                    eval_data=FIXTURE, max_accuracy_drop=100.0)
    assert path == output and output.is_file()
    reference = export.export_checkpoint(tmp_path / "run", "squad", tmp_path / "fp32.onnx")
    cost = accuracy_cost(reference, output, "squad", FIXTURE)
    assert cost.metric == "f1" and set(cost.reference) == {"exact_match", "f1"}
    questions = sum(len(p["qas"]) for article in json.loads(FIXTURE.read_text())["data"]
                    for p in article["paragraphs"])
    assert cost.examples == questions
    assert cost.drop == pytest.approx(cost.reference["f1"] - cost.candidate["f1"])


@pytest.mark.parametrize("extra,message", [
    (["--task", "encoder", "--eval", "{rows}"], "--eval: a encoder export has no task"),
    (["--task", "classification", "--max-accuracy-drop", "1"], "needs --eval FILE"),
    (["--task", "classification", "--eval", "{missing}"], "nope.tsv: not found"),
    (["--task", "classification", "--quantize", "int8", "--keep-float", "ffn"],
     "--keep-float: unknown role 'ffn'"),
    (["--task", "classification", "--optimize", "--fusions", "Attention,Flash"],
     "--fusions: unknown fused operator 'Flash'"),
    (["--task", "classification", "--eval", "{rows}", "--max-accuracy-drop", "-1"],
     "--max-accuracy-drop: expected points >= 0"),
])
def test_misuse_is_one_line(setup: Setup, tmp_path: Path, capsys, extra: list[str],
                            message: str) -> None:
    args = [a.format(rows=setup.rows, missing=tmp_path / "nope.tsv") for a in extra]
    code = cli.main(["export", "--checkpoint", str(setup.run), "--output",
                     str(tmp_path / "x.onnx"), *args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("popbert: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "x.onnx").exists()


def test_check_drop_threshold_is_inclusive() -> None:
    cost = AccuracyCost("classification", "rows.tsv", 10, 0.9, "accuracy",
                        {"accuracy": 80.0}, {"accuracy": 79.0}, 1.0)
    check_drop(cost, 1.0, Path("m.onnx"))
    check_drop(cost, None, Path("m.onnx"))
    with pytest.raises(AccuracyError, match="loses 1.00 points of accuracy"):
        check_drop(cost, 0.5, Path("m.onnx"))

"""`popbert predict squad` and `predict classify`: ONNX Runtime alone predicts like the training
path does.

A small random squad model (exported with its vocabulary and window sizes in the ONNX metadata)
answers the SQuAD fixture; the answers are arbitrary but must be exactly those the torch path
(popbert.data.squad features → InferenceSession → the same decoding) gives. A small random
classification model labels a TSV file with the probabilities the torch path gives for
`popbert.data.classification`'s encoding, whatever the batch size and whether the export's
sequence axis is symbolic (batches cut to their longest row) or fixed.

Length buckets (rows run longest first, each batch cut to its longest row) must give every row
the outputs it gets alone, back in the input order, with less padding than batches in input
order; the counts of truncated rows and of multi-window or cut SQuAD questions must be right.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_helpers import random_task_run

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.cli import main as cli
from popbert.config import TaskConfig, load_config
from popbert.data.classification import (
    ClassificationData,
    encode_classification,
    encode_classification_counted,
    read_classification_file,
)
from popbert.data.squad import (
    Question,
    WindowOptions,
    build_windows,
    decode_answers,
    read_squad,
    squad_features,
    window_arrays,
)
from popbert.data.tokenization import (
    WordPieceTokenizer,
    bundled_vocab_path,
    make_tokenizer,
    parse_vocab,
)
from popbert.runtime.buckets import length_order
from popbert.runtime.session import InferenceSession
from popbert.serve.predict import (
    ClassifyPredictor,
    PredictStats,
    SquadPredictor,
    read_texts,
    window_cuts,
)

FIXTURE = Path(__file__).parent.parent / "fixtures" / "squad" / "squad-v1.1-sample.json"
SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=40",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]
TASK = TaskConfig(name="squad", lowercase=True, doc_stride=8, max_query_length=12)


@pytest.fixture(scope="module")
def squad_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory holding a random squad model, as `popbert finetune squad` writes it."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TASK
    cfg.data.vocab_file = str(bundled_vocab_path())
    run = tmp_path_factory.mktemp("squad") / "run"
    weights = random_task_run(run, cfg, "squad", seed=3)
    return run, {n: torch.from_numpy(w) for n, w in weights.items()}


@pytest.fixture(scope="module")
def exported(squad_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("onnx") / "squad.onnx"
    assert cli.main(["export", "--checkpoint", str(squad_run[0]), "--task", "squad",
                     "--output", str(output)]) == 0
    return output


def torch_predictions(weights, n_best_size: int = 20):
    """The training side: popbert.data.squad features, torch backend logits, same decoding."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TASK
    vocab = parse_vocab(bundled_vocab_path().read_text(encoding="utf-8"))
    questions, _ = read_squad(FIXTURE)
    features = squad_features(questions, make_tokenizer(vocab), vocab,
                              WindowOptions(40, TASK.doc_stride, TASK.max_query_length))
    session = InferenceSession(build_bert(cfg.model, task="squad", with_loss=False,
                                          zeros=True).model())
    session.load_weights(weights, strict=False)
    logits = session.run(features.arrays)
    return decode_answers(questions, features.windows, logits["start_logits"].numpy(),
                          logits["end_logits"].numpy(), n_best_size, 30)


def run_cli_without_torch(args: list[str]) -> None:
    """Run `popbert <args>` in a fresh interpreter and fail if it exits non-zero or imports
    torch: serving must work where only ONNX Runtime is installed."""
    code = ("import sys\n"
            "from popbert.cli.main import main\n"
            f"rc = main({args!r})\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded\n"
            "sys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr


def test_predict_imports_no_torch(exported: Path, tmp_path: Path) -> None:
    output = tmp_path / "predictions.json"
    run_cli_without_torch(["predict", "squad", "--model", str(exported), "--data", str(FIXTURE),
                           "--output", str(output)])
    predictions = json.loads(output.read_text())
    questions, _ = read_squad(FIXTURE)
    assert list(predictions) == [q.id for q in questions]
    nbest = json.loads((tmp_path / "nbest_predictions.json").read_text())
    for qid, answer in predictions.items():
        assert nbest[qid][0]["text"] == answer
        assert answer in questions[0].context + questions[2].context


def test_onnx_runtime_answers_exactly_like_the_torch_path(squad_run, exported: Path) -> None:
    questions, _ = read_squad(FIXTURE)
    served, served_nbest = SquadPredictor(exported).predict(questions)
    expected, expected_nbest = torch_predictions(squad_run[1])
    assert served == expected
    for qid, candidates in expected_nbest.items():
        assert [c.text for c in served_nbest[qid]] == [c.text for c in candidates]
        np.testing.assert_allclose([c.probability for c in served_nbest[qid]],
                                   [c.probability for c in candidates], atol=1e-4)
    assert len(set(served.values())) > 1  # not vacuous: different questions, different spans


def test_a_fixed_batch_export_is_padded_per_run(squad_run, exported: Path,
                                                tmp_path: Path) -> None:
    fixed = tmp_path / "fixed.onnx"
    assert cli.main(["export", "--checkpoint", str(squad_run[0]), "--task", "squad",
                     "--output", str(fixed), "--batch-size", "7"]) == 0
    predictor = SquadPredictor(fixed)
    assert predictor.batch_size == 7 and predictor.sequence_length == 40
    questions, _ = read_squad(FIXTURE)
    assert predictor.predict(questions)[0] == SquadPredictor(exported).predict(questions)[0]


def test_wrong_models_are_one_line_errors(squad_run, tmp_path: Path) -> None:
    encoder = tmp_path / "encoder.onnx"
    assert cli.main(["export", "--checkpoint", str(squad_run[0]), "--task", "encoder",
                     "--output", str(encoder)]) == 0
    for model, fragment in [(encoder, "is not a popbert squad export"),
                            (tmp_path / "missing.onnx", "missing.onnx: not found")]:
        result = subprocess.run([sys.executable, "-m", "popbert", "predict", "squad",
                                 "--model", str(model), "--data", str(FIXTURE), "--output",
                                 str(tmp_path / "p.json")],
                                capture_output=True, text=True, timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert fragment in lines[0]
        assert not (tmp_path / "p.json").exists()


CLASSIFY = TaskConfig(name="classification", lowercase=True, num_labels=3,
                      labels=["neg", "neutral", "pos"])
TEXTS = ["a short one", "the film was long and, frankly, far too slow for anyone to enjoy at all",
         "fine", "it is what it is", "an unremarkable but pleasant afternoon at the cinema",
         "bad", "good good good"]


@pytest.fixture(scope="module")
def classify_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A run directory holding a random classification model (labels in its config)."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = CLASSIFY
    cfg.data.vocab_file = str(bundled_vocab_path())
    run = tmp_path_factory.mktemp("classify") / "run"
    # A pooler and head far from uniform, so that rows get different labels.
    head = ("Classifier", "NSP/Pool")
    weights = random_task_run(run, cfg, "classification", seed=5,
                              scale=lambda n: 60 if n.startswith(head) else 3)
    return run, {n: torch.from_numpy(w) for n, w in weights.items()}


@pytest.fixture(scope="module")
def classify_files(classify_run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default (dynamic batch and length) export, a fixed one, and a labelled TSV file."""
    directory = tmp_path_factory.mktemp("classify-onnx")
    files = {"dynamic": directory / "dynamic.onnx", "fixed": directory / "fixed.onnx",
             "tsv": directory / "texts.tsv"}
    assert cli.main(["export", "--checkpoint", str(classify_run[0]), "--task",
                     "classification", "--output", str(files["dynamic"])]) == 0
    assert cli.main(["export", "--checkpoint", str(classify_run[0]), "--task",
                     "classification", "--output", str(files["fixed"]), "--batch-size", "4",
                     "--sequence-length", "40"]) == 0
    labels = ["pos", "neg", "neutral", "pos", "pos", "neg", "pos"]
    files["tsv"].write_text("sentence\tlabel\n" + "".join(
        f"{text}\t{label}\n" for text, label in zip(TEXTS, labels)), encoding="utf-8")
    return files


def torch_probabilities(weights, path: Path) -> np.ndarray:
    """The training side: popbert.data.classification's encoding, the torch backend's logits."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = CLASSIFY
    arrays = encode_classification(read_classification_file(path, require_labels=False),
                                   WordPieceTokenizer(bundled_vocab_path()), 40)
    session = InferenceSession(build_bert(cfg.model, task="classification", with_loss=False,
                                          zeros=True).model())
    session.load_weights(weights, strict=False)
    return torch.softmax(session.run(arrays)["logits"], dim=-1).numpy()


def test_classify_matches_the_torch_path_at_any_batch(classify_run, classify_files,
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    expected = torch_probabilities(classify_run[1], classify_files["tsv"])
    names = CLASSIFY.labels
    assert len(set(expected.argmax(axis=1))) > 1  # not vacuous: different rows, labels
    output = tmp_path / "predictions.jsonl"
    assert cli.main(["predict", "classify", "--model", str(classify_files["dynamic"]),
                     "--data", str(classify_files["tsv"]), "--output", str(output),
                     "--batch-size", "3"]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(2, 2 + len(TEXTS)))
    assert [r["label"] for r in records] == [names[i] for i in expected.argmax(axis=1)]
    probabilities = np.array([[r["probabilities"][n] for n in names] for r in records])
    np.testing.assert_allclose(probabilities, expected, atol=1e-4)
    assert records[0]["gold"] == "pos"
    metrics = json.loads(capsys.readouterr().out)
    gold = ["pos", "neg", "neutral", "pos", "pos", "neg", "pos"]
    assert metrics["accuracy"] == pytest.approx(
        np.mean([r["label"] == g for r, g in zip(records, gold)]))
    data = read_texts(classify_files["tsv"])
    dynamic = ClassifyPredictor(classify_files["dynamic"])
    fixed = ClassifyPredictor(classify_files["fixed"])
    assert (dynamic.batch_size, dynamic.dynamic_sequence, dynamic.sequence_length) == (
        None, True, 40)
    assert (fixed.batch_size, fixed.dynamic_sequence, fixed.sequence_length) == (4, False, 40)
    for predictor, batch_size in ((dynamic, 1), (dynamic, 16), (fixed, 1)):
        np.testing.assert_allclose(predictor.probabilities(data, batch_size), expected,
                                   atol=1e-4, err_msg=f"{predictor.path.name} {batch_size}")


def test_classify_a_text_file_without_torch(classify_run, classify_files,
                                            tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS[:3]) + "\n\n", encoding="utf-8")
    output = tmp_path / "out.jsonl"
    run_cli_without_torch(["predict", "classify", "--model", str(classify_files["dynamic"]),
                           "--data", str(texts), "--output", str(output)])
    records = [json.loads(line) for line in output.read_text().splitlines()]
    expected = torch_probabilities(classify_run[1], classify_files["tsv"])[:3]
    assert [r["line"] for r in records] == [1, 2, 3] and "gold" not in records[0]
    np.testing.assert_allclose([[r["probabilities"][n] for n in CLASSIFY.labels]
                                for r in records], expected, atol=1e-4)


def test_classify_errors_are_one_line(exported: Path, classify_files, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    texts = tmp_path / "texts.txt"
    texts.write_text("good\nbad\n", encoding="utf-8")
    other_labels = tmp_path / "other.tsv"
    other_labels.write_text("sentence\tlabel\ngood\tpos\nbad\tterrible\n", encoding="utf-8")
    for model, data, extra, fragment in [
            (exported, classify_files["tsv"], [], "is not a popbert classification export"),
            # A column named that the file lacks, or a .txt file that has none: never ignored.
            (classify_files["dynamic"], classify_files["tsv"], ["--label-column", "gold"],
             "--label-column gold: "),
            (classify_files["dynamic"], texts, ["--text-column", "review"],
             "--text-column review: "),
            (classify_files["dynamic"], texts, ["--label-column", "label"],
             "--label-column label: "),
            # Gold labels the model lacks: refused before anything is predicted or written.
            (classify_files["dynamic"], other_labels, [], "unknown label 'terrible'"),
            (classify_files["dynamic"], tmp_path / "missing.tsv", [], "missing.tsv: not found"),
            (classify_files["dynamic"], empty, [], "no text lines"),
            (classify_files["dynamic"], classify_files["tsv"], ["--batch-size", "0"],
             "--batch-size must be >= 1")]:
        result = subprocess.run([sys.executable, "-m", "popbert", "predict", "classify",
                                 "--model", str(model), "--data", str(data), "--output",
                                 str(tmp_path / "p.jsonl"), *extra],
                                capture_output=True, text=True, timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert fragment in lines[0], lines[0]
        assert not (tmp_path / "p.jsonl").exists()


# Rows of very different lengths (3 to 40 tokens, one over-long), not in length order.
MIXED = ["fine", "good " * 50, "it is what it is", "good " * 20, "bad",
         "the film was long and, frankly, far too slow", "good " * 37, "ok"]


def mixed_arrays() -> dict[str, np.ndarray]:
    data = ClassificationData(Path("mixed.txt"), MIXED, None, None, list(range(1, 9)))
    return encode_classification(data, WordPieceTokenizer(bundled_vocab_path()), 40)


def test_length_buckets_give_each_rows_own_outputs_in_input_order(classify_files,
                                                                  exported: Path) -> None:
    arrays = mixed_arrays()
    lengths = arrays["input_mask"].sum(axis=1)
    assert lengths.tolist() == [3, 40, 7, 22, 3, 14, 39, 3]
    order = length_order(arrays["input_mask"])
    assert order.tolist() == [1, 6, 3, 5, 2, 0, 4, 7]  # longest first, ties in input order
    predictor = ClassifyPredictor(classify_files["dynamic"])
    # Each row alone: a batch of one at its own length, nothing sorted.
    alone = np.concatenate([predictor.run({k: v[i:i + 1] for k, v in arrays.items()}, 1)["logits"]
                            for i in range(len(MIXED))])
    # Negative control: in the order the rows ran, the outputs are not the rows' own, so the
    # order must be restored (and the rows' outputs differ from each other).
    assert not np.allclose(alone[order], alone, atol=1e-3)
    for batch_size in (3, 8):
        bucketed = predictor.run(arrays, batch_size)["logits"]
        unsorted = predictor.run(arrays, batch_size, bucket=False)["logits"]
        # Pad positions are masked out exactly (their attention weight underflows to 0). The
        # last layer computes [CLS] alone, a [rows, H] product: ONNX Runtime picks its kernel
        # by the row count (one row alone: a vector product), so the sums run in another order
        # than in a batch (3e-6 measured on these logits of about 2.7); 1e-5, what `popbert
        # serve` promises for a text alone or batched.
        np.testing.assert_allclose(bucketed, alone, rtol=0, atol=1e-5)
        np.testing.assert_allclose(unsorted, alone, rtol=0, atol=1e-5)
    # SQuAD: each window's start/end logits (padded back to the export's length with
    # the task's per-token fill) are those it gets alone, in the windows' order.
    squad = SquadPredictor(exported)
    questions, _ = read_squad(FIXTURE)
    windows = build_windows(questions, squad.tokenizer, squad.vocab, squad.options)
    window_order = length_order(window_arrays(windows)["input_mask"])
    assert window_order.tolist() != list(range(len(windows)))
    start, end = squad.logits(windows, batch_size=4)
    for i, window in enumerate(windows):
        one_start, one_end = squad.logits([window], batch_size=1)
        np.testing.assert_allclose(start[i], one_start[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(end[i], one_end[0], rtol=0, atol=1e-6)


def test_length_buckets_compute_less_padding(classify_files,
                                             caplog: pytest.LogCaptureFixture) -> None:
    arrays = mixed_arrays()
    lengths = arrays["input_mask"].sum(axis=1)
    predictor = ClassifyPredictor(classify_files["dynamic"])
    bucketed, in_order = PredictStats(), PredictStats()
    predictor.run(arrays, 2, stats=bucketed)
    predictor.run(arrays, 2, stats=in_order, bucket=False)
    # Batches of two cut to their longest row: (40, 39) (22, 14) (7, 3) (3, 3) sorted,
    # (3, 40) (7, 22) (3, 14) (39, 3) in input order.
    assert (bucketed.computed, in_order.computed) == (2 * (40 + 22 + 7 + 3),
                                                      2 * (40 + 22 + 14 + 39))
    assert bucketed.tokens == in_order.tokens == lengths.sum() == 131
    assert (bucketed.batches, bucketed.rows, bucketed.bucketed) == (4, 8, True)
    assert bucketed.padding_share == pytest.approx((144 - 131) / 144)
    assert bucketed.padding_share < in_order.padding_share / 4
    # A fixed-length export pads every row to its length (4-row batches, the last one's filler
    # rows computed too), says so once when loaded, and still answers.
    with caplog.at_level(logging.INFO, logger="popbert.serve.predict"):
        fixed = ClassifyPredictor(classify_files["fixed"])
    assert sum("fixed sequence length of 40" in r.getMessage() for r in caplog.records) == 1
    padded = PredictStats()
    fixed.run(arrays, 2, stats=padded)
    assert (padded.batches, padded.computed, padded.bucketed, padded.cut) == (2, 8 * 40, False,
                                                                              False)
    assert "every row padded to the export's length, 40" in padded.describe()
    assert "in input order, each batch cut" in in_order.describe()
    assert padded.padding_share == pytest.approx(1 - 131 / 320)


def test_cut_counts(classify_files, exported: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str],
                    caplog: pytest.LogCaptureFixture) -> None:
    # Classification pairs at length 40: 37 word pieces fit beside [CLS] [SEP] [SEP] ("good" is
    # one piece); rows 2 and 4 have more and are truncated, row 1 fits exactly.
    sizes = [(20, 17), (20, 18), (1, 1), (40, 5), (36, 1)]
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("sentence1\tsentence2\tlabel\n" + "".join(
        f"{'good ' * a}\t{'good ' * b}\tpos\n" for a, b in sizes), encoding="utf-8")
    data = read_classification_file(tsv, require_labels=False)
    tokenizer = WordPieceTokenizer(bundled_vocab_path())
    arrays, truncated = encode_classification_counted(data, tokenizer, 40)
    assert truncated == 2
    for name, value in encode_classification(data, tokenizer, 40).items():
        np.testing.assert_array_equal(arrays[name], value)  # the same arrays as training's
    output = tmp_path / "pairs.jsonl"
    with caplog.at_level(logging.INFO):
        assert cli.main(["predict", "classify", "--model", str(classify_files["dynamic"]),
                         "--data", str(tsv), "--output", str(output)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["truncated"] == 2 and summary["batches"] == 1
    assert 0 < summary["padding_share"] < 1 and summary["examples_per_second"] > 0
    assert summary["model_rows_per_second"] > 0 and summary["examples"] == 5
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("predict:"))
    assert "5 rows in 1 batch," in line and "2 truncated to 40 tokens" in line, line
    assert set(json.loads(output.read_text().splitlines()[0])) == {"line", "label",
                                                                   "probabilities", "gold"}
    # SQuAD at length 40, max_query_length 12: a context takes one window up to 40 - 3 -
    # (question tokens, at most 12) pieces. Questions a: fits; b: long context; c: long
    # question (cut to 12), short context; d: both.
    questions = [Question("a", "good bad", "good " * 5),
                 Question("b", "good bad", "good " * 60, context_index=1),
                 Question("c", "good " * 20, "good " * 5, context_index=2),
                 Question("d", "good " * 15, "good " * 30, context_index=3)]
    predictor = SquadPredictor(exported)
    windows = build_windows(questions, predictor.tokenizer, predictor.vocab, predictor.options)
    per_question = [sum(w.question_index == i for w in windows) for i in range(4)]
    assert per_question[0] == per_question[2] == 1 and min(per_question[1::2]) > 1
    assert window_cuts(windows) == (2, 2)
    stats = PredictStats()
    answers, _ = predictor.predict(questions, stats=stats)
    assert list(answers) == ["a", "b", "c", "d"]
    assert (stats.examples, stats.rows) == (4, len(windows))
    assert (stats.multi_window, stats.query_truncated) == (2, 2)
    assert stats.summary()["multi_window"] == 2 and "truncated" not in stats.summary()

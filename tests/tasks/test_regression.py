"""Regression through the classification task (`finetune classify --regression`): one score per
row, the mean squared error as transformers' `num_labels=1` computes it, Pearson and Spearman as
scipy computes them, and the score carried through the export to `predict classify`.

Tolerances: the loss and its gradients against transformers with the same weights at 1e-5 (the
float32 forward and backward of two implementations of the same graph); the correlations
against scipy at 1e-12 (the same float64 formula); ONNX Runtime's scores against the torch
backend's at 1e-4 (the export's own check, `popbert.export.inference.VERIFY_ATOL`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import scipy.stats
import torch
from bert_helpers import padded_batch, small_config

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import TaskConfig
from popbert.cli.main import main
from popbert.data.classification import regression_metrics
from popbert.hf import mapping as hf
from popbert.runtime.session import TrainingSession

FIXTURES = Path(__file__).parent.parent / "fixtures" / "classification"
RELATEDNESS = FIXTURES / "relatedness.tsv"  # 60 scored pairs from Wikipedia leads (README)
REGRESSION = TaskConfig(name="classification", num_labels=1)


def test_the_loss_and_gradients_are_transformers_regression() -> None:
    import transformers

    torch.manual_seed(0)
    config = small_config(task=REGRESSION)
    model = build_bert(config, task="classification", seed=3).model()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    theirs_state = hf.to_hf_architecture(weights, config, "BertForSequenceClassification")
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=config.max_position_embeddings, num_labels=1,
        problem_type="regression")
    hf_config._attn_implementation = "eager"
    reference = transformers.BertForSequenceClassification(hf_config)
    missing, unexpected = reference.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in theirs_state.items()},
        strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k]

    batch = {k: v for k, v in padded_batch(config, batch_size=4, seed=1).items()
             if k in ("input_ids", "segment_ids", "input_mask")}
    batch["labels"] = np.array([0.0, 1.5, 4.0, 2.25], np.float32)
    session = TrainingSession(model, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0))
    ours = session.forward(batch)
    ours["loss"].backward()
    out = reference(input_ids=torch.from_numpy(batch["input_ids"]),
                    token_type_ids=torch.from_numpy(batch["segment_ids"]),
                    attention_mask=torch.from_numpy(batch["input_mask"]),
                    labels=torch.from_numpy(batch["labels"]))
    out.loss.backward()
    torch.testing.assert_close(ours["logits"], out.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["loss"], out.loss, atol=1e-5, rtol=0)
    grads = hf.to_hf_architecture({n: p.grad.numpy() for n, p in session.named_parameters},
                                  config, "BertForSequenceClassification")
    params = dict(reference.named_parameters())
    for name in ("classifier.weight", "classifier.bias", "bert.pooler.dense.weight",
                 "bert.encoder.layer.0.attention.self.query.weight"):
        expected = params[name].grad.numpy()
        assert np.abs(grads[name] - expected).max() <= 1e-4 * np.abs(expected).max() + 1e-7


def test_pearson_and_spearman_are_scipys() -> None:
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 6, 200).astype(np.float64)  # ties, as STS-B's scores have
    predicted = gold + rng.normal(0, 1.5, 200)
    predicted[:20] = np.round(predicted[:20])  # ties among the predictions too
    ours = regression_metrics(predicted, gold)
    assert ours["pearson"] == pytest.approx(scipy.stats.pearsonr(predicted, gold)[0], abs=1e-12)
    assert ours["spearman"] == pytest.approx(scipy.stats.spearmanr(predicted, gold)[0],
                                             abs=1e-12)
    assert ours["mse"] == pytest.approx(float(np.mean((predicted - gold) ** 2)))



@pytest.mark.e2e
def test_finetune_export_and_predict_one_score(pretrained: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "reg"
    assert main(["finetune", "classify", "--checkpoint", str(pretrained), "--train",
                 str(RELATEDNESS), "--regression", "--epochs", "2", "--max-seq-length", "64",
                 "--device", "cpu", "-o", str(run)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads((run / "eval_results.json").read_text())
    assert printed == results and results["examples"] == 60
    rows = [json.loads(line) for line in (run / "eval_predictions.jsonl").read_text()
            .splitlines()]
    scores = np.array([r["score"] for r in rows])
    gold = np.array([r["gold"] for r in rows])
    assert sorted(set(gold)) == [0.0, 1.0, 2.0]
    recomputed = regression_metrics(scores, gold)
    for key in ("pearson", "spearman", "mse"):
        assert results[key] == pytest.approx(recomputed[key], abs=1e-9)
    task = json.loads(json.dumps(__import__("yaml").safe_load(
        (run / "config.yaml").read_text())["model"]["task"]))
    assert task["num_labels"] == 1 and task["labels"] is None

    model = tmp_path / "reg.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "classification", "--output",
                 str(model)]) == 0
    predictions = tmp_path / "scores.jsonl"
    capsys.readouterr()
    assert main(["predict", "classify", "--model", str(model), "--data", str(RELATEDNESS),
                 "-o", str(predictions)]) == 0
    served = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [r["line"] for r in served] == [r["line"] for r in rows]
    np.testing.assert_allclose([r["score"] for r in served], scores, atol=1e-4)
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["pearson"] == pytest.approx(results["pearson"], abs=1e-3)
    # the same output again: an earlier predict classify output is replaced
    assert main(["predict", "classify", "--model", str(model), "--data", str(RELATEDNESS),
                 "-o", str(predictions)]) == 0


def test_a_score_that_is_not_a_number_is_one_line(pretrained: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.tsv"
    lines = RELATEDNESS.read_text().splitlines()
    lines[3] = lines[3].rsplit("\t", 1)[0] + "\tvery similar"
    bad.write_text("\n".join(lines) + "\n")
    for argv, fragment in (
            (["--train", str(bad), "--regression"], f"{bad}:4: score 'very similar' in column "
                                                    "'label' is not a finite number"),
            (["--train", str(RELATEDNESS), "--regression", "--labels", "0,1,2"],
             "finetune.labels names classes, but finetune.regression trains one score")):
        run = tmp_path / "run"
        capsys.readouterr()
        assert main(["finetune", "classify", "--checkpoint", str(pretrained), *argv,
                     "--device", "cpu", "-o", str(run)]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines()
                  if line.startswith("popbert: error:")]
        assert len(errors) == 1 and fragment in errors[0], errors
        assert not run.exists()

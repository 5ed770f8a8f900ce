"""Sequence (and sentence-pair) classification: a pooled-output classifier on rows of a
TSV/CSV/JSONL file; accuracy and F1 on the evaluation file (the training file when none is
given). With `finetune.regression` (`--regression`) the head gives one score per row, trained
with the mean squared error on the label column's numbers and scored by Pearson's and
Spearman's correlations (STS-B's), as transformers' `num_labels=1`. The head's weights map to
Hugging Face's `classifier.*`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.builders import layers
from popbert.builders.bert import BertGraph, Encoded, register_task
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.data.classification import (
    ClassificationData,
    classification_metrics,
    encode_classification,
    label_ids,
    label_list,
    label_scores,
    read_classification_file,
    regression_metrics,
)
from popbert.data.tokenization import load_tokenizer
from popbert.errors import UsageError
from popbert.graph.annotations import LossMean
from popbert.graph.builder import Builder
from popbert.tasks.task import Flag, Infer, Setting, Task

log = logging.getLogger(__name__)

NAME = "classification"


def num_labels(config: BertConfig) -> int:
    """Outputs of the classification head, from `model.task.num_labels`: the classes, or 1 for
    one score (regression)."""
    value = config.task.num_labels
    if value is None or value < 1:
        raise ValueError(f"model.task.num_labels must be an integer >= 1 for the classification "
                         f"task (1: regression), got {value!r}")
    return value


@register_task(NAME, pooled_only=True)
def classification_head(b: Builder, config: BertConfig, init: layers.WeightInit,
                        graph: BertGraph, encoded: Encoded, with_loss: bool) -> None:
    """Logits [B, num_labels] from the family's pooled output (BERT's tanh pooler on [CLS],
    ModernBERT's prediction head on [CLS] or the mean), then dropout and one dense layer, like
    `BertForSequenceClassification` / `ModernBertForSequenceClassification`; with `labels` [B],
    the mean cross-entropy and the accuracy. One output (`num_labels` 1) is a score: its loss
    is the mean squared error against float `labels` [B], as transformers' regression."""
    classes = num_labels(config)
    pooled = layers.dropout(b, encoded.pooled, config.hidden_dropout, "Classifier/Dropout")
    logits = layers.dense(b, pooled, config.hidden_size, classes, init, "Classifier")
    graph.outputs["logits"] = logits
    if not with_loss:
        return
    graph.loss_mean = LossMean()  # over the rows, regression's too
    if classes == 1:
        targets = graph.add_float_input("labels", [graph.batch_size])
        with b.nameScope("Loss"):
            scores = layers.squeeze(b, logits, [-1], "Scores", "last_axis")
            error = b.aiOnnx.sub([scores, targets], "Error")
            loss = b.aiOnnx.reducemean([b.aiOnnx.mul([error, error], "Squared")], "loss",
                                       keepdims=0)
        graph.outputs["loss"] = loss
        return
    labels = graph.add_input("labels", [graph.batch_size])
    with b.nameScope("Loss"):
        loss = layers.softmax_cross_entropy(b, logits, labels, None, "loss")
        accuracy = layers.accuracy(b, logits, labels, None, "accuracy")
    graph.outputs.update({"loss": loss, "accuracy": accuracy})


@dataclass
class ClassificationRun:
    """One run's data: the training features, the evaluation rows, and the label names (None:
    one score per row, regression) with the evaluation rows' label ids or scores."""

    setting: Setting
    labels: list[str] | None
    arrays: dict[str, np.ndarray]
    eval_data: ClassificationData
    eval_arrays: dict[str, np.ndarray]
    eval_targets: np.ndarray = field(repr=False)

    def task_config(self) -> TaskConfig:
        if self.labels is None:
            return TaskConfig(name=NAME, hf_architecture=self.setting.hf_architecture,
                              lowercase=self.setting.lowercase, num_labels=1)
        return TaskConfig(name=NAME, hf_architecture=self.setting.hf_architecture,
                          lowercase=self.setting.lowercase, num_labels=len(self.labels),
                          labels=self.labels)

    def score(self, infer: Infer, output_dir: Path) -> dict[str, float]:
        """Score the evaluation file: accuracy and F1, or for one score Pearson's and
        Spearman's correlations and the mean squared error (eval_results.json), and each line's
        prediction (eval_predictions.jsonl)."""
        logits = infer(self.eval_arrays)["logits"]
        if self.labels is None:
            return self._score_regression(logits[:, 0], output_dir)
        names = self.labels
        predicted = logits.argmax(axis=-1)
        metrics: dict[str, Any] = classification_metrics(predicted, self.eval_targets,
                                                         len(names))
        metrics["examples"] = len(self.eval_targets)
        atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
        atomic_write_text(output_dir / "eval_predictions.jsonl", "".join(
            json.dumps({"line": line, "label": names[int(p)], "gold": names[int(g)]}) + "\n"
            for line, p, g in zip(self.eval_data.lines, predicted, self.eval_targets)))
        log.info("classification %s: accuracy %.4f, F1 %.4f", self.eval_data.path,
                 metrics["accuracy"], metrics["f1"])
        classes = np.unique(predicted)
        if len(classes) == 1 and len(np.unique(self.eval_targets)) > 1:
            # Accuracy alone hides it (it is the majority class's share): say so.
            log.warning("classification %s: all %d predictions are %r while the file holds %d "
                        "classes: the classifier collapsed to one class (try another --lr, "
                        "more --epochs, or a better pre-trained checkpoint)",
                        self.eval_data.path, len(predicted), names[int(classes[0])],
                        len(np.unique(self.eval_targets)))
        return metrics

    def _score_regression(self, scores: np.ndarray, output_dir: Path) -> dict[str, float]:
        metrics: dict[str, Any] = regression_metrics(scores, self.eval_targets)
        metrics["examples"] = len(self.eval_targets)
        atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
        atomic_write_text(output_dir / "eval_predictions.jsonl", "".join(
            json.dumps({"line": line, "score": float(p), "gold": float(g)}) + "\n"
            for line, p, g in zip(self.eval_data.lines, scores, self.eval_targets)))
        log.info("regression %s: Pearson %.4f, Spearman %.4f, MSE %.4g", self.eval_data.path,
                 metrics["pearson"], metrics["spearman"], metrics["mse"])
        return metrics


def read(cfg: Any, setting: Setting) -> ClassificationRun:
    """The training rows as features, the evaluation rows, and the label names (the
    `finetune.labels` given, else the training file's, sorted), or with `finetune.regression`
    the label column's scores."""
    f = cfg.finetune
    tokenizer = load_tokenizer(setting.vocab, setting.lowercase)
    columns = (f.text_column, f.pair_column, f.label_column)
    train = read_classification_file(Path(f.train_file), *columns, strict=cfg.data.strict)
    eval_data = (read_classification_file(Path(f.eval_file), *columns, strict=cfg.data.strict)
                 if f.eval_file else train)
    if (eval_data.pairs is None) != (train.pairs is None):
        raise UsageError(f"{eval_data.path}: its text columns differ from {train.path}'s (one "
                         "or two texts)")
    arrays = encode_classification(train, tokenizer, setting.max_seq_length)
    eval_arrays = encode_classification(eval_data, tokenizer, setting.max_seq_length)
    if f.regression:
        if f.labels:
            raise UsageError("finetune.labels names classes, but finetune.regression trains "
                             "one score: drop --labels or --regression")
        arrays["labels"] = label_scores(train, f.label_column)
        log.info("regression: %d examples, scores %.4g to %.4g", len(train),
                 arrays["labels"].min(), arrays["labels"].max())
        return ClassificationRun(setting, None, arrays, eval_data, eval_arrays,
                                 label_scores(eval_data, f.label_column))
    labels = list(f.labels) if f.labels else label_list(train)
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise UsageError(f"finetune.labels: need at least two distinct labels, got {labels}")
    arrays["labels"] = label_ids(train, labels)
    log.info("classification: %d examples, labels %s", len(train), labels)
    return ClassificationRun(setting, labels, arrays, eval_data, eval_arrays,
                             label_ids(eval_data, labels))


TASK = Task(
    predictor="popbert.serve.predict:ClassifyPredictor",
    name=NAME, command="classify",
    help="sentence or sentence-pair classification (TSV/CSV/JSONL)",
    description="Fine-tune a pooled-output classifier; report accuracy and F1 on --eval "
                "(default: the training file) as JSON.",
    files="rows", read=read,
    flags=(
        Flag("--eval", "finetune.eval_file", {"metavar": "FILE"}, file="rows"),
        Flag("--text-column", "finetune.text_column",
             {"help": "default: sentence, text, sentence1, question, question1 or premise"}),
        Flag("--text-pair-column", "finetune.pair_column",
             {"help": "second text (default with no --text-column: sentence2, question2 or "
                      "hypothesis, if present)"}),
        Flag("--label-column", "finetune.label_column", {"help": "default: label"}),
        Flag("--labels", "finetune.labels",
             {"metavar": "A,B,...",
              "help": "class names in id order (default: the training file's, sorted)"},
             list_of_text=True),
        Flag("--regression", "finetune.regression",
             {"action": "store_true",
              "help": "one score per row (the label column's numbers, e.g. STS-B's 0-5): mean "
                      "squared error; Pearson and Spearman on --eval"}),
    ),
    default_max_seq_length=128, metric_keys=("loss", "accuracy"),
    # classes: accuracy, F1; with finetune.regression: Pearson, Spearman, MSE
    final_metrics=("accuracy", "f1", "pearson", "spearman", "mse"),
    # Measured (benchmarks/finetune_defaults.py, RESULTS.md "Fine-tuning defaults by model
    # size"): a small model needs a far higher rate and more epochs than BERT-Base's recipe.
    size_defaults=((1e-3, 10), (2e-5, 3)),
    hf_architectures={"bert": "BertForSequenceClassification",
                      "modernbert": "ModernBertForSequenceClassification"},
    # activation: what a one-output model's score goes through when served (a CrossEncoder's)
    outputs=("logits",), metadata_keys=("num_labels", "labels", "activation"),
    head_keys=("model.modernbert.classifier_pooling",),
    always_print_metrics=True,
)

__all__ = ["NAME", "TASK", "classification_head", "num_labels", "read"]

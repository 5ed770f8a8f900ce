"""Token classification (named entities, and any per-word tagging): a label for each word from
the family's per-token features, trained on CoNLL or JSON-lines files (IOB1, IOB2 or BIOES tags,
normalised to IOB2) with the first sub-token of each word labelled, long sentences in
overlapping windows; scored by entity precision, recall and F1 as seqeval computes them. The
head's weights map to Hugging Face's `*ForTokenClassification` `classifier.*` (ModernBERT's
prediction head before it)."""

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
from popbert.builders.families import family_of
from popbert.data.token_classification import (
    TaggedData,
    Window,
    decode_tags,
    encode_tagged,
    entity_metrics,
    label_list,
    read_tagged,
    write_conll,
)
from popbert.data.tokenization import load_tokenizer
from popbert.errors import UsageError
from popbert.graph.annotations import LossMean
from popbert.graph.builder import Builder
from popbert.tasks.task import Flag, Infer, Setting, Task

log = logging.getLogger(__name__)

NAME = "token-classification"
IGNORE = -100  # the label of positions that are not scored: [CLS], [SEP], padding, later pieces


@register_task(NAME)
def token_head(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
               encoded: Encoded, with_loss: bool) -> None:
    """Logits [B, S, num_labels] per token: the family's per-token features (none for BERT,
    ModernBERT's prediction head), dropout and one dense layer, like
    `BertForTokenClassification` / `ModernBertForTokenClassification`; with `labels` [B, S]
    (`IGNORE` where not scored), the mean cross-entropy over the scored tokens and their
    accuracy."""
    classes = config.task.num_labels
    if classes is None or classes < 2:
        raise ValueError(f"model.task.num_labels must be >= 2 for token classification, got "
                         f"{classes!r}")
    features = family_of(config).span_features
    with b.nameScope("Tokens"):
        tokens = encoded.hidden if features is None else features(b, config, init,
                                                                  encoded.hidden)
        if features is None:
            tokens = layers.dropout(b, tokens, config.hidden_dropout, "Dropout")
        logits = layers.dense(b, tokens, config.hidden_size, classes, init, "Classifier")
    graph.outputs["logits"] = logits
    if not with_loss:
        return
    labels = graph.add_input("labels", [graph.batch_size, graph.sequence_length], signed=True)
    graph.loss_mean = LossMean("labels", IGNORE)  # over the labelled tokens
    with b.nameScope("Loss"):
        flat = b.addConstant(np.array([-1, classes], np.int64), "flat_shape")
        flat_logits = b.aiOnnx.reshape([logits, flat], "FlatLogits")
        flat_labels = b.aiOnnx.reshape([labels, b.addConstant(np.array([-1], np.int64),
                                                              "flat_labels")], "FlatLabels")
        loss = layers.softmax_cross_entropy(b, flat_logits, flat_labels, IGNORE, "loss")
        accuracy = layers.accuracy(b, flat_logits, flat_labels, IGNORE, "accuracy")
    graph.outputs.update({"loss": loss, "accuracy": accuracy})


@dataclass
class TokenClassificationRun:
    """One run's data: the training windows, the evaluation sentences and their windows."""

    setting: Setting
    labels: list[str]
    arrays: dict[str, np.ndarray]
    eval_data: TaggedData
    eval_arrays: dict[str, np.ndarray] = field(repr=False)
    eval_windows: list[Window] = field(repr=False)

    def task_config(self) -> TaskConfig:
        return TaskConfig(name=NAME, hf_architecture=self.setting.hf_architecture,
                          lowercase=self.setting.lowercase, num_labels=len(self.labels),
                          labels=self.labels)

    def score(self, infer: Infer, output_dir: Path) -> dict[str, float]:
        """Tag the evaluation sentences: entity precision, recall and F1, overall and per type
        (eval_results.json), and each word with its gold and predicted tag
        (eval_predictions.conll)."""
        logits = infer(self.eval_arrays)["logits"]
        predicted = decode_tags(self.eval_data, self.eval_windows, logits.argmax(axis=-1),
                                self.labels)
        gold = [sentence.tags or [] for sentence in self.eval_data.sentences]
        metrics: dict[str, Any] = entity_metrics(gold, predicted)
        metrics["sentences"] = len(gold)
        atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
        write_conll(output_dir / "eval_predictions.conll", self.eval_data, predicted)
        log.info("token classification %s: entity precision %.4f, recall %.4f, F1 %.4f",
                 self.eval_data.path, metrics["precision"], metrics["recall"], metrics["f1"])
        # The run's summary takes numbers: the per-type scores stay in eval_results.json.
        return {k: v for k, v in metrics.items() if k != "per_type"}


def read(cfg: Any, setting: Setting) -> TokenClassificationRun:
    """The training sentences as windows of labelled first sub-tokens, and the evaluation
    sentences (the training file's when none is given); labels: `finetune.labels` or the
    training file's IOB2 tags."""
    f = cfg.finetune
    tokenizer = load_tokenizer(setting.vocab, setting.lowercase)
    train = read_tagged(Path(f.train_file), f.tag_scheme)
    eval_data = read_tagged(Path(f.eval_file), f.tag_scheme) if f.eval_file else train
    labels = list(f.labels) if f.labels else label_list(train)
    if "O" not in labels or len(labels) < 2 or len(set(labels)) != len(labels):
        raise UsageError(f"finetune.labels: need distinct IOB2 tags with O among them, got "
                         f"{labels}")
    arrays, _ = encode_tagged(train, tokenizer, labels, setting.max_seq_length,
                              label_all_subtokens=f.label_all_subtokens)
    # a tag the evaluation file has that training never saw is refused here, before training
    eval_arrays, eval_windows = encode_tagged(eval_data, tokenizer, labels,
                                              setting.max_seq_length,
                                              label_all_subtokens=f.label_all_subtokens)
    eval_arrays.pop("labels", None)
    log.info("token classification: %d sentences (%d windows), %s tags %s",
             len(train.sentences), len(arrays["input_ids"]), train.source_scheme, labels)
    return TokenClassificationRun(setting, labels, arrays, eval_data, eval_arrays,
                                  eval_windows)


TASK = Task(
    predictor="popbert.serve.tag:TagPredictor",
    name=NAME, command="token-classification", aliases=("ner",),
    help="token classification / named entities (CoNLL or JSON lines)",
    description="Fine-tune a per-token tagger on CoNLL (the word first, the tag last) or JSON "
                "lines ({\"tokens\", \"tags\"}); IOB1, IOB2 or BIOES tags; report entity "
                "precision, recall and F1 on --eval (default: the training file) as JSON.",
    files="tagged", read=read,
    flags=(
        Flag("--eval", "finetune.eval_file", {"metavar": "FILE"}, file="tagged"),
        Flag("--tag-scheme", "finetune.tag_scheme",
             {"choices": ("IOB1", "IOB2", "BIOES"),
              "help": "the files' tag scheme (default: detected; IOB2 is trained)"}),
        Flag("--label-all-subtokens", "finetune.label_all_subtokens",
             {"action": "store_true",
              "help": "label every sub-token of a word, not only its first"}),
        Flag("--labels", "finetune.labels",
             {"metavar": "O,B-X,...", "help": "IOB2 tags in id order (default: the training "
                                              "file's)"}, list_of_text=True),
    ),
    default_max_seq_length=128, metric_keys=("loss", "accuracy"),
    final_metrics=("precision", "recall", "f1"),
    # Not measured for this task: transformers' token-classification example's recipe (5e-5,
    # 3 epochs) for BERT-Base, classification's measured small-model values below.
    size_defaults=((1e-3, 10), (5e-5, 3)),
    hf_architectures={"bert": "BertForTokenClassification",
                      "modernbert": "ModernBertForTokenClassification"},
    outputs=("logits",), metadata_keys=("num_labels", "labels"),
    per_token_outputs={"logits": 0.0},  # each word is read at its own first piece
    always_print_metrics=True,
)

__all__ = ["IGNORE", "NAME", "TASK", "read", "token_head"]

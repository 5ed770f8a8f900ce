"""Fine-tuning heads: SQuAD span prediction and pooled-output sequence classification.

Importing this module registers the tasks `squad` and `classification` with
`popbert.builders.bert.register_task`, so `build_bert(config, task="squad")` builds BERT with the
head (and, with `with_loss`, its loss) in the same ONNX graph as the encoder. Weight names map to
Hugging Face's `qa_outputs.*` and `classifier.*` (see `popbert.io.hf_mapping`).

Task parameters live in `config.task` (a `TaskConfig`, the `model.task` mapping of a run config),
so a fine-tuned checkpoint's config is enough to rebuild its graph: `num_labels` for
classification.
"""

from __future__ import annotations

import numpy as np

from popbert.builders import layers
from popbert.builders.bert import BertGraph, Encoded, register_task
from popbert.builders.bert_config import BertConfig
from popbert.builders.families import family_of
from popbert.graph.builder import Builder

SQUAD = "squad"
CLASSIFICATION = "classification"


def num_labels(config: BertConfig) -> int:
    """Classes of the classification head, from `model.task.num_labels`."""
    value = config.task.num_labels
    if value is None or value < 2:
        raise ValueError(f"model.task.num_labels must be an integer >= 2 for the classification "
                         f"task, got {value!r}")
    return value


@register_task(SQUAD)
def span_head(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
              encoded: Encoded, with_loss: bool) -> None:
    """Start/end logits per token ([B, S] each), like `BertForQuestionAnswering`.

    With labels (`start_positions`, `end_positions`: [B] token indices; 0 = [CLS] for a window
    without the answer, as Google's run_squad.py does) the loss is the mean of the start and end
    cross-entropies.
    """
    h = config.hidden_size
    features = family_of(config).span_features
    with b.nameScope("Squad"):
        tokens = encoded.hidden if features is None else features(b, config, init,
                                                                  encoded.hidden)
        logits = layers.dense(b, tokens, h, 2, init, "Logits")  # [B, S, 2]
        start, end = layers.split(b, logits, 2, -1, "Split")
        start_logits = layers.squeeze(b, start, [-1], "StartLogits", "last_axis")
        end_logits = layers.squeeze(b, end, [-1], "EndLogits", "last_axis")
    graph.outputs["start_logits"] = start_logits
    graph.outputs["end_logits"] = end_logits
    if not with_loss:
        return
    start_positions = graph.add_input("start_positions", [graph.batch_size])
    end_positions = graph.add_input("end_positions", [graph.batch_size])
    with b.nameScope("Loss"):
        start_loss = layers.softmax_cross_entropy(b, start_logits, start_positions, None,
                                                  "start_loss")
        end_loss = layers.softmax_cross_entropy(b, end_logits, end_positions, None, "end_loss")
        total = b.aiOnnx.add([start_loss, end_loss], "Sum")
        loss = b.aiOnnx.mul([total, layers.scalar(b, 0.5, np.float32, "half")], "loss")
        start_accuracy = layers.accuracy(b, start_logits, start_positions, None,
                                         "start_accuracy")
        end_accuracy = layers.accuracy(b, end_logits, end_positions, None, "end_accuracy")
    graph.outputs.update({"loss": loss, "start_accuracy": start_accuracy,
                          "end_accuracy": end_accuracy})


@register_task(CLASSIFICATION)
def classification_head(b: Builder, config: BertConfig, init: layers.WeightInit,
                        graph: BertGraph, encoded: Encoded, with_loss: bool) -> None:
    """Logits [B, num_labels] from the family's pooled output (BERT's tanh pooler on [CLS],
    ModernBERT's prediction head on [CLS] or the mean), then dropout and one dense layer, like
    `BertForSequenceClassification` / `ModernBertForSequenceClassification`; with `labels` [B],
    the mean cross-entropy and the accuracy."""
    classes = num_labels(config)
    pooled = layers.dropout(b, encoded.pooled, config.hidden_dropout, "Classifier/Dropout")
    logits = layers.dense(b, pooled, config.hidden_size, classes, init, "Classifier")
    graph.outputs["logits"] = logits
    if not with_loss:
        return
    labels = graph.add_input("labels", [graph.batch_size])
    with b.nameScope("Loss"):
        loss = layers.softmax_cross_entropy(b, logits, labels, None, "loss")
        accuracy = layers.accuracy(b, logits, labels, None, "accuracy")
    graph.outputs.update({"loss": loss, "accuracy": accuracy})


__all__ = ["CLASSIFICATION", "SQUAD", "classification_head", "num_labels", "span_head"]

"""SQuAD v1.1 extractive question answering: the span head on question/context windows; the
official exact match and F1 on the file to predict when it has answers. The head's weights map
to Hugging Face's `qa_outputs.*`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.builders import layers
from popbert.builders.bert import BertGraph, Encoded, register_task
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.builders.families import family_of
from popbert.data.squad import (
    WindowOptions,
    decode_answers,
    read_squad,
    squad_features,
    write_predictions,
)
from popbert.data.squad_metric import evaluate as squad_evaluate
from popbert.data.tokenization import load_tokenizer
from popbert.graph.builder import Builder
from popbert.tasks.task import Flag, Infer, Setting, Task

log = logging.getLogger(__name__)

NAME = "squad"


@register_task(NAME)
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


@dataclass
class SquadRun:
    """One run's data: the training windows, and the questions to predict (if any)."""

    setting: Setting
    arrays: dict[str, np.ndarray]
    windows: WindowOptions
    tokenizer: Any  # the HF tokenizers backend of the checkpoint's vocabulary
    vocab: Any  # its special tokens' ids
    to_predict: tuple[list, dict] | None  # (questions, dataset) of finetune.eval_file
    eval_file: str | None
    n_best_size: int
    max_answer_length: int

    def task_config(self) -> TaskConfig:
        return TaskConfig(name=NAME, hf_architecture=self.setting.hf_architecture,
                          lowercase=self.setting.lowercase, doc_stride=self.windows.doc_stride,
                          max_query_length=self.windows.max_query_length)

    def score(self, infer: Infer, output_dir: Path) -> dict[str, float]:
        """Predict `finetune.eval_file` (predictions.json) and score it if it has answers."""
        if self.to_predict is None:
            return {}
        questions, dataset = self.to_predict
        features = squad_features(questions, self.tokenizer, self.vocab, self.windows)
        logits = infer(features.arrays)
        predictions, nbest = decode_answers(questions, features.windows,
                                            logits["start_logits"], logits["end_logits"],
                                            self.n_best_size, self.max_answer_length)
        write_predictions(output_dir / "predictions.json", predictions, nbest)
        if not any(q.answers for q in questions):
            return {}
        metrics = squad_evaluate(dataset["data"], predictions)
        atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
        log.info("SQuAD %s: exact match %.2f, F1 %.2f", self.eval_file, metrics["exact_match"],
                 metrics["f1"])
        return metrics


def read(cfg: Any, setting: Setting) -> SquadRun:
    """The training file's questions as windows of `max_seq_length` tokens, and the file to
    predict (`finetune.eval_file`), read now so that a bad one stops the run before training."""
    f = cfg.finetune
    windows = WindowOptions(setting.max_seq_length, f.doc_stride, f.max_query_length)
    windows.validate()
    text_tokenizer = load_tokenizer(setting.vocab, setting.lowercase)
    questions, _ = read_squad(Path(f.train_file))
    to_predict = read_squad(Path(f.eval_file)) if f.eval_file else None
    features = squad_features(questions, text_tokenizer.backend, text_tokenizer.roles, windows,
                              training=True, source=str(f.train_file))
    log.info("SQuAD: %d questions → %d training windows", len(questions),
             len(features.arrays["input_ids"]))
    return SquadRun(setting, features.arrays, windows, text_tokenizer.backend,
                    text_tokenizer.roles, to_predict, f.eval_file, f.n_best_size,
                    f.max_answer_length)


TASK = Task(
    predictor="popbert.serve.predict:SquadPredictor",
    name=NAME, command="squad",
    help="SQuAD v1.1 question answering",
    description="Fine-tune the span head on a SQuAD v1.1 training file; write "
                "predictions.json for --predict and, if it has answers, the official EM/F1 "
                "(printed as JSON).",
    files="squad", read=read,
    flags=(
        Flag("--predict", "finetune.eval_file", {"metavar": "FILE.json"}, file="squad"),
        Flag("--doc-stride", "finetune.doc_stride", {"type": int}),
        Flag("--max-query-length", "finetune.max_query_length", {"type": int}),
        Flag("--n-best-size", "finetune.n_best_size", {"type": int}),
        Flag("--max-answer-length", "finetune.max_answer_length", {"type": int}),
    ),
    default_max_seq_length=384, metric_keys=("loss", "start_accuracy", "end_accuracy"),
    final_metrics=("exact_match", "f1"),
    # Small models: classification's measured rate at the preset's epochs (no SQuAD-sized data
    # in the repository to measure on).
    size_defaults=((1e-3, 2), (5e-5, 2)),
    hf_architectures={"bert": "BertForQuestionAnswering",
                      "modernbert": "ModernBertForQuestionAnswering"},
    outputs=("start_logits", "end_logits"), metadata_keys=("doc_stride", "max_query_length"),
    # below any real span's logit: a masked position never makes the n-best list
    per_token_outputs={"start_logits": -10000.0, "end_logits": -10000.0},
)

__all__ = ["NAME", "TASK", "read", "span_head"]

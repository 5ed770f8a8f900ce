"""Fine-tuning from a checkpoint: SQuAD v1.1 span prediction and sequence classification.

`finetune_squad` / `finetune_classify` take any popbert checkpoint (a pre-training run, or a
Hugging Face model brought in with `popbert import-hf`), build the task graph (encoder + head +
loss, `popbert.builders.tasks`), load every matching weight (the head starts fresh and is
reported), train with AdamW (bias-corrected, no decay on biases and norms) under linear warmup
and decay, save a checkpoint, and evaluate: SQuAD writes `predictions.json` in the official
format and the official EM/F1; classification reports accuracy and F1.

Everything a later `popbert export --task squad|classification` or `popbert export-hf` needs
(task, window sizes, labels, lowercasing) is recorded in the checkpoint's `model.task`.

Output directory: `config.yaml`, `vocab.txt`, `metrics.jsonl` (training loss), the checkpoint
under `checkpoints/step-NNNNNN/`, and `eval_results.json` (+ `predictions.json`,
`nbest_predictions.json` for SQuAD).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import popbert.builders.tasks  # noqa: F401  (registers the squad and classification heads)
from popbert.atomic import atomic_write_bytes, atomic_write_text
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.config import RunConfig, config_from_dict, dump_config
from popbert.errors import CheckpointError, ConfigError, UsageError
from popbert.io import checkpoint as ckpt
from popbert.io import run_dir
from popbert.io.hf_checkpoint import VOCAB, checkpoint_vocab
from popbert.io.run_dir import step_dir
from popbert.observe.tracking import MetricsLogger
from popbert.optimizers import set_lr
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import InferenceSession, TrainingSession
from popbert.train.factories import lr_schedule, optimizer_factory
from popbert.train.loop import RecordHook, RunStopped, train_loop

log = logging.getLogger(__name__)

# GroupBERT pre-trains without dropout and fine-tunes with BERT's 0.1 (Chelombiev et al. 2021).
GROUPBERT_FINETUNE_DROPOUT = 0.1
SQUAD_ARCHITECTURE = "BertForQuestionAnswering"
CLASSIFICATION_ARCHITECTURE = "BertForSequenceClassification"


@dataclass
class TrainOptions:
    """Fine-tuning hyperparameters (defaults: Devlin et al.'s SQuAD/GLUE recipe)."""

    epochs: int = 2
    lr: float = 5e-5
    batch_size: int = 32
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    seed: int = 42
    device: str = "auto"
    threads: int | None = None
    log_every: int = 10
    eval_batch_size: int = 64
    dropout: float | None = None  # hidden and attention dropout; None = the checkpoint's

    def validate(self) -> None:
        """One-line UsageError naming the command-line flag of a bad value."""
        checks = [("epochs", self.epochs >= 1), ("lr", self.lr > 0),
                  ("batch-size", self.batch_size >= 1),
                  ("warmup-proportion", 0.0 <= self.warmup_proportion <= 1.0),
                  ("weight-decay", self.weight_decay >= 0),
                  ("log-every", self.log_every >= 1),
                  ("eval-batch-size", self.eval_batch_size >= 1),
                  ("threads", self.threads is None or self.threads >= 1),
                  ("dropout", self.dropout is None or 0.0 <= self.dropout < 1.0)]
        for flag, ok in checks:
            if not ok:
                value = getattr(self, flag.replace("-", "_"))
                raise UsageError(f"--{flag}: invalid value {value!r}")


@dataclass
class Pretrained:
    """What fine-tuning starts from: the run config, the weights and the vocabulary."""

    config: RunConfig
    weights: dict[str, torch.Tensor]
    vocab: Path
    lowercase: bool
    step_dir: Path


@dataclass
class FinetuneResult:
    output_dir: Path
    checkpoint: Path
    steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    fresh: list[str] = field(default_factory=list)


def load_pretrained(checkpoint: Path) -> Pretrained:
    """A checkpoint's weights, config and vocabulary (one-line errors for what is missing)."""
    restored = ckpt.load_checkpoint(checkpoint, weights_only=True)
    step_dir = ckpt.find_checkpoint(checkpoint)
    cfg = config_from_dict(restored.config, source=str(step_dir / "config.yaml"))
    vocab = checkpoint_vocab(checkpoint, cfg.data.vocab_file)
    if vocab is None:
        if cfg.data.vocab_file is not None:
            raise CheckpointError(f"{checkpoint}: its vocabulary {cfg.data.vocab_file} is gone "
                                  f"and there is no {VOCAB} in the run directory")
        from popbert.data.tokenization import bundled_vocab_path

        vocab = bundled_vocab_path()
    entries = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    if entries > cfg.model.vocab_size:
        raise CheckpointError(f"{vocab}: {entries} vocabulary entries but the checkpoint's "
                              f"model.vocab_size is {cfg.model.vocab_size}")
    return Pretrained(cfg, restored.weights, vocab, cfg.model.task.lowercase, step_dir)


def task_model_config(model: BertConfig, sequence_length: int, task: TaskConfig,
                      dropout: float | None = None) -> BertConfig:
    """The checkpoint's model at `sequence_length` for one process (no placement, unpacked),
    with the fine-tuning `task` settings in place of the checkpoint's, and `dropout` for both
    dropouts if given — else the checkpoint's, except GroupBERT, which pre-trains without dropout
    and fine-tunes with it (`GROUPBERT_FINETUNE_DROPOUT`)."""
    if sequence_length > model.max_position_embeddings:
        raise UsageError(f"--max-seq-length ({sequence_length}) exceeds the checkpoint's "
                         f"model.max_position_embeddings ({model.max_position_embeddings})")
    values = {**model.__dict__, "sequence_length": sequence_length, "layers_per_ipu": None,
              "recompute": False, "dialect": "onnx",
              "max_predictions_per_seq": min(model.max_predictions_per_seq, sequence_length),
              "task": task}
    if dropout is None and model.architecture == "groupbert":
        dropout = GROUPBERT_FINETUNE_DROPOUT
    if dropout is not None:
        values["hidden_dropout"] = values["attention_dropout"] = dropout
    if "packed" in values:  # fine-tuning features are one sequence per row
        values["packed"] = False
    return BertConfig(**values)


def run_config(pretrained: Pretrained, model: BertConfig, options: TrainOptions, steps: int,
               output_dir: Path) -> RunConfig:
    """The fine-tuning run as a popbert config (saved with the checkpoint; drives the
    optimizer and schedule through `popbert.train.pretrain`'s factories)."""
    base = pretrained.config.to_dict()
    base["model"] = {**model.__dict__}
    base["data"] = {**base["data"], "vocab_file": str(Path(output_dir).resolve() / VOCAB)}
    base["optimizer"] = {
        "name": "adamw", "lr": options.lr, "weight_decay": options.weight_decay,
        "bias_correction": True, "max_grad_norm": options.max_grad_norm,
        "warmup_steps": int(options.warmup_proportion * steps), "warmup_start_lr": 0.0,
        "decay": "linear", "end_lr": 0.0, "eps": 1e-6, "betas": [0.9, 0.999],
        "loss_scaling": "none", "loss_scale": 1.0}
    base["execution"] = {"device": options.device, "micro_batch_size": options.batch_size,
                         "threads": options.threads}
    base["training"] = {"steps": steps, "log_every": options.log_every, "seed": options.seed}
    return config_from_dict(base, source="fine-tuning options")


def _batches(arrays: Mapping[str, np.ndarray], batch_size: int, epochs: int, seed: int
             ) -> Iterator[dict[str, torch.Tensor]]:
    """Shuffled mini-batches, a new order each epoch; the last one of an epoch may be short."""
    n = len(next(iter(arrays.values())))
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(n)
        for first in range(0, n, batch_size):
            rows = order[first:first + batch_size]
            yield {k: torch.from_numpy(v[rows]) for k, v in arrays.items()}


def train(cfg: RunConfig, task: str, weights: Mapping[str, torch.Tensor],
          arrays: Mapping[str, np.ndarray], output_dir: Path, epochs: int,
          vocab: Path, on_record: RecordHook | None = None,
          evaluate: Callable[[dict[str, torch.Tensor]], Mapping[str, float]] | None = None
          ) -> tuple[dict[str, torch.Tensor], list[str], Path]:
    """Train the `task` graph from `weights` through the training loop and save the checkpoint
    (with `vocab`) in `output_dir`; returns (trained weights, fresh weight names, checkpoint).
    `on_record`: see `train_loop` (a sweep's pruner). The checkpoint is written and `evaluate`
    scores the weights before the metrics logger closes, so the checkpoint can be uploaded
    (`tracking.log_checkpoint`) and the scores reach the tracked run's summary (as
    `eval_<name>`)."""
    e = cfg.execution
    if e.replicas != 1 or e.pipeline or e.replicated_tensor_sharding:
        raise ConfigError("fine-tuning runs in one process: set execution.replicas=1, "
                          "execution.pipeline=false, execution.replicated_tensor_sharding=false")
    if cfg.execution.threads:
        torch.set_num_threads(cfg.execution.threads)
    torch.manual_seed(cfg.training.seed)
    graph = build_bert(cfg.model, task=task, seed=cfg.training.seed)
    session = TrainingSession(graph.model(), graph.loss, optimizer_factory(cfg),
                              SessionOptions.from_config(cfg))
    params = dict(session.named_parameters)
    for name, value in weights.items():
        if name in params and tuple(value.shape) != tuple(params[name].shape):
            raise CheckpointError(f"checkpoint weight {name} has shape {tuple(value.shape)}, "
                                  f"the {task} graph needs {tuple(params[name].shape)}")
    session.load_weights({k: v for k, v in weights.items() if k in params}, strict=False)
    fresh = [name for name in params if name not in weights]
    if fresh:
        log.info("initialised fresh (not in the checkpoint): %s", ", ".join(fresh))
    schedule = lr_schedule(cfg)
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    t = cfg.training
    tracker = MetricsLogger(output_dir, cfg.to_dict())
    saved: Path | None = None
    try:
        train_loop(session, _batches(arrays, e.micro_batch_size, epochs, t.seed),
                   steps=t.steps, log_every=t.log_every, schedule=schedule, tracker=tracker,
                   samples_per_step=e.micro_batch_size, desc=f"finetune {task}",
                   divergence_factor=t.divergence_factor, on_record=on_record)
        trained = session.weights()
        saved = _save(output_dir, cfg, trained, vocab)
        if evaluate is not None:
            tracker.summarize(evaluate(trained))
    finally:
        tracker.close(checkpoint=saved)
    return trained, fresh, saved


def infer(model: BertConfig, task: str, weights: Mapping[str, torch.Tensor],
          arrays: Mapping[str, np.ndarray], batch_size: int, device: str
          ) -> dict[str, np.ndarray]:
    """The task graph's outputs (no dropout) for all rows of `arrays`, in batches."""

    graph = build_bert(model, task=task, with_loss=False, zeros=True)
    session = InferenceSession(graph.model(), SessionOptions(device=device))
    session.load_weights(weights, strict=False)
    n = len(arrays["input_ids"])
    outputs: dict[str, list[np.ndarray]] = {}
    inputs = ("input_ids", "segment_ids", "input_mask")
    for first in tqdm(range(0, n, batch_size), desc=f"evaluate {task}", unit="batch",
                      dynamic_ncols=True, disable=n <= batch_size):
        batch = {k: torch.from_numpy(arrays[k][first:first + batch_size]) for k in inputs}
        for key, value in session.run(batch).items():
            outputs.setdefault(key, []).append(value.float().cpu().numpy())
    return {k: np.concatenate(v) for k, v in outputs.items()}


def _save(output_dir: Path, cfg: RunConfig, weights: Mapping[str, torch.Tensor],
          vocab: Path) -> Path:
    config_yaml = dump_config(cfg)
    atomic_write_text(output_dir / "config.yaml", config_yaml)
    if vocab.resolve() != (output_dir / VOCAB).resolve():
        atomic_write_bytes(output_dir / VOCAB, vocab.read_bytes())
    # No model.onnx: the task graph is rebuilt from config.yaml (export, export-hf), and a copy
    # would double the checkpoint's size.
    return ckpt.save_checkpoint(step_dir(output_dir, cfg.training.steps),
                                ckpt.Checkpoint(step=cfg.training.steps, weights=dict(weights)),
                                config_yaml)


def _run_in(output_dir: Path, body: Callable[[], FinetuneResult]) -> FinetuneResult:
    """Run `body()` writing into `output_dir`; a failure before any checkpoint leaves no
    half-written directory behind (like `popbert pretrain`)."""
    created = run_dir.create_output_dir(output_dir)
    try:
        return body()
    except RunStopped:
        raise  # a stopped (pruned) run keeps the metrics it logged
    except BaseException:
        run_dir.remove_if_empty_run(output_dir, created)
        raise


# ----------------------------------------------------------------------------------------------
# SQuAD


def finetune_squad(checkpoint: Path, train_file: Path, output_dir: Path,
                   predict_file: Path | None = None, options: TrainOptions | None = None,
                   max_seq_length: int = 384, doc_stride: int = 128, max_query_length: int = 64,
                   n_best_size: int = 20, max_answer_length: int = 30,
                   on_record: RecordHook | None = None) -> FinetuneResult:
    """Fine-tune on a SQuAD v1.1 training file; predict (and score, if it has answers)
    `predict_file`. `on_record`: see `train_loop`."""
    from popbert.data.squad import (
        WindowOptions,
        decode_answers,
        read_squad,
        squad_features,
        write_predictions,
    )
    from popbert.data.squad_metric import evaluate
    from popbert.data.tokenization import make_tokenizer, parse_vocab

    options = options or TrainOptions()
    options.validate()
    windows = WindowOptions(max_seq_length, doc_stride, max_query_length)
    windows.validate()
    if n_best_size < 1 or max_answer_length < 1:
        raise UsageError("--n-best-size and --max-answer-length must be >= 1")
    pretrained = load_pretrained(checkpoint)
    vocab = parse_vocab(pretrained.vocab.read_text(encoding="utf-8"))
    tokenizer = make_tokenizer(vocab, pretrained.lowercase)
    questions, _ = read_squad(train_file)
    to_predict = read_squad(predict_file) if predict_file is not None else None
    features = squad_features(questions, tokenizer, vocab, windows, training=True,
                              source=str(train_file))
    model = task_model_config(pretrained.config.model, max_seq_length, TaskConfig(
        name="squad", hf_architecture=SQUAD_ARCHITECTURE, lowercase=pretrained.lowercase,
        doc_stride=doc_stride, max_query_length=max_query_length), options.dropout)
    steps = options.epochs * math.ceil(len(features) / options.batch_size)
    output_dir = Path(output_dir)
    run_dir.check_output_dir(output_dir)
    cfg = run_config(pretrained, model, options, steps, output_dir)
    log.info("SQuAD: %d questions → %d training windows of %d tokens; %d steps", len(questions),
             len(features), max_seq_length, steps)

    def body() -> FinetuneResult:
        metrics: dict[str, float] = {}

        def score(weights: dict[str, torch.Tensor]) -> dict[str, float]:
            """Predict `predict_file` with the trained weights (and score it if it has answers)."""
            predict_questions, dataset = to_predict
            feats = squad_features(predict_questions, tokenizer, vocab, windows)
            logits = infer(model, "squad", weights, feats.arrays, options.eval_batch_size,
                           options.device)
            predictions, nbest = decode_answers(predict_questions, feats.windows,
                                                logits["start_logits"], logits["end_logits"],
                                                n_best_size, max_answer_length)
            write_predictions(output_dir / "predictions.json", predictions, nbest)
            if any(q.answers for q in predict_questions):
                metrics.update(evaluate(dataset["data"], predictions))
                atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
                log.info("SQuAD %s: exact match %.2f, F1 %.2f", predict_file,
                         metrics["exact_match"], metrics["f1"])
            return metrics

        _, fresh, saved = train(cfg, "squad", pretrained.weights, features.arrays, output_dir,
                                options.epochs, pretrained.vocab, on_record,
                                score if to_predict is not None else None)
        return FinetuneResult(output_dir, saved, steps, metrics, fresh)

    return _run_in(output_dir, body)


# ----------------------------------------------------------------------------------------------
# Classification


def finetune_classify(checkpoint: Path, train_file: Path, output_dir: Path,
                      eval_file: Path | None = None, options: TrainOptions | None = None,
                      max_seq_length: int = 128, text_column: str | None = None,
                      pair_column: str | None = None, label_column: str = "label",
                      labels: list[str] | None = None,
                      on_record: RecordHook | None = None) -> FinetuneResult:
    """Fine-tune a pooled-output classifier on a TSV/CSV/JSONL file; report accuracy and F1 on
    `eval_file` (or on the training file when none is given). `on_record`: see `train_loop`."""
    from popbert.data.classification import (
        classification_metrics,
        encode_classification,
        label_ids,
        label_list,
        read_classification_file,
    )
    from popbert.data.tokenization import WordPieceTokenizer

    options = options or TrainOptions()
    options.validate()
    pretrained = load_pretrained(checkpoint)
    tokenizer = WordPieceTokenizer(pretrained.vocab, lowercase=pretrained.lowercase)
    train_data = read_classification_file(train_file, text_column, pair_column, label_column)
    names = list(labels) if labels else label_list(train_data)
    if len(names) < 2 or len(set(names)) != len(names):
        raise UsageError(f"--labels: need at least two distinct labels, got {names}")
    eval_data = (read_classification_file(eval_file, text_column, pair_column, label_column)
                 if eval_file is not None else train_data)
    if (eval_data.pairs is None) != (train_data.pairs is None):
        raise UsageError(f"{eval_data.path}: its text columns differ from {train_data.path}'s "
                         "(one or two texts)")
    arrays = encode_classification(train_data, tokenizer, max_seq_length)
    arrays["labels"] = label_ids(train_data, names)
    eval_arrays = encode_classification(eval_data, tokenizer, max_seq_length)
    eval_labels = label_ids(eval_data, names)
    model = task_model_config(pretrained.config.model, max_seq_length, TaskConfig(
        name="classification", hf_architecture=CLASSIFICATION_ARCHITECTURE,
        lowercase=pretrained.lowercase, num_labels=len(names), labels=names), options.dropout)
    steps = options.epochs * math.ceil(len(train_data) / options.batch_size)
    output_dir = Path(output_dir)
    run_dir.check_output_dir(output_dir)
    cfg = run_config(pretrained, model, options, steps, output_dir)
    log.info("classification: %d examples, labels %s; %d steps", len(train_data), names, steps)

    def body() -> FinetuneResult:
        metrics: dict[str, float] = {}

        def score(weights: dict[str, torch.Tensor]) -> dict[str, float]:
            """Classify the evaluation file with the trained weights; accuracy and F1."""
            logits = infer(model, "classification", weights, eval_arrays,
                           options.eval_batch_size, options.device)["logits"]
            predicted = logits.argmax(axis=-1)
            metrics.update(classification_metrics(predicted, eval_labels, len(names)))
            metrics["examples"] = len(eval_labels)
            atomic_write_text(output_dir / "eval_results.json", json.dumps(metrics, indent=2))
            atomic_write_text(output_dir / "eval_predictions.jsonl", "".join(
                json.dumps({"line": line, "label": names[int(p)], "gold": names[int(g)]}) + "\n"
                for line, p, g in zip(eval_data.lines, predicted, eval_labels)))
            log.info("classification %s: accuracy %.4f, F1 %.4f", eval_data.path,
                     metrics["accuracy"], metrics["f1"])
            return metrics

        _, fresh, saved = train(cfg, "classification", pretrained.weights, arrays, output_dir,
                                options.epochs, pretrained.vocab, on_record, score)
        return FinetuneResult(output_dir, saved, steps, metrics, fresh)

    return _run_in(output_dir, body)


__all__ = ["FinetuneResult", "Pretrained", "TrainOptions", "finetune_classify",
           "finetune_squad", "infer", "load_pretrained", "task_model_config", "train"]

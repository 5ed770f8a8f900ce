"""Fine-tuning: the job every task (`popbert.tasks`) runs.

A fine-tuning run is a `RunConfig` whose `finetune.task` names a task of `popbert.tasks.TASKS`
(`finetune_config` makes one from the task's preset, `finetune-<task>`). The `Trainer` starts it
from `finetune.checkpoint` (a pre-training run, or a Hugging Face model brought in with
`popbert import-hf`): the job has the task read its data, takes the checkpoint's model with the
task's head (the head starts fresh and is reported), derives `training.steps` from
`finetune.epochs` and `optimizer.warmup_steps` from `finetune.warmup_proportion`, and at the end
has the task score the trained weights.

Everything a later `popbert export --task <task>` or `popbert export-hf` needs (task, window
sizes, labels, lowercasing) is recorded in the checkpoint's `model.task`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from popbert.atomic import atomic_write_bytes
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.builders.families import FAMILIES, family_of
from popbert.config import (
    RunConfig,
    config_from_dict,
    load_config,
    parse_override,
    preset_path,
)
from popbert.config.sections import FINETUNE_TASKS
from popbert.data.loader import length_grouped_order
from popbert.data.tokenization import load_tokenizer, tokenizer_file_name
from popbert.errors import CheckpointError, ConfigError, UsageError
from popbert.hf.checkpoint import VOCAB, checkpoint_vocab
from popbert.io import checkpoint as ckpt
from popbert.runtime.buckets import run_by_length
from popbert.runtime.options import SessionOptions
from popbert.runtime.protocol import Session
from popbert.runtime.session import InferenceSession
from popbert.tasks import TASKS, Setting, Task, TaskData, task_named
from popbert.train.jobs import Job

log = logging.getLogger(__name__)

# GroupBERT pre-trains without dropout and fine-tunes with BERT's 0.1 (Chelombiev et al. 2021).
# GroupBERT's fine-tuning dropout (`popbert.builders.families.Family.finetune_dropout`).
GROUPBERT_FINETUNE_DROPOUT = FAMILIES["groupbert"].finetune_dropout


# The flags every `popbert finetune TASK` takes (argparse names) and the `args` of a fine-tuning
# sweep: the config key each one sets (the checkpoint and training file, then the run's knobs).
# Each task adds its own (`popbert.tasks.Task.flags`): `FLAG_KEYS` holds them all.
RUN_FLAG_KEYS = {
    "checkpoint": "finetune.checkpoint", "train": "finetune.train_file",
    "epochs": "finetune.epochs", "warmup_proportion": "finetune.warmup_proportion",
    "max_seq_length": "finetune.max_seq_length", "eval_batch_size": "finetune.eval_batch_size",
    "dropout": "finetune.dropout", "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay",
    "max_grad_norm": "optimizer.max_grad_norm", "batch_size": "execution.micro_batch_size",
    "device": "execution.device", "threads": "execution.threads", "seed": "training.seed",
    "log_every": "training.log_every",
}
FLAG_KEYS = {**RUN_FLAG_KEYS, **{flag.dest: flag.key for task in TASKS.values()
                                 for flag in task.flags}}
# The flags (and sweep `args`) that name files: the checkpoint and the data.
PATH_FLAGS = ("checkpoint", "train", *dict.fromkeys(
    flag.dest for task in TASKS.values() for flag in task.flags if flag.file))
# The flags every fine-tuning task takes that set its `finetune` section.
COMMON_FLAGS = ("checkpoint", "train", "epochs", "warmup_proportion", "max_seq_length",
                "eval_batch_size", "dropout")


def task_flags(task: str) -> tuple[str, ...]:
    """The flags (argparse names) of `popbert finetune <task>` that set its `finetune` section:
    `COMMON_FLAGS` and the task's own."""
    return (*COMMON_FLAGS, *(flag.dest for flag in TASKS[task].flags))


# The learning rate and epochs a fine-tuning run takes when neither the command line nor a
# config file names them (`finetune_config`), by the checkpoint's width: BERT-Base (hidden 768)
# and wider keep the BERT paper's recipe (the finetune-* presets' values); a small model needs
# far more. Measured for classification (`benchmarks/finetune_defaults.py`, RESULTS.md
# "Fine-tuning defaults by model size"); between the two widths the rate is log-linear in the
# width and the epochs linear. SQuAD's small-model values are classification's rate and the
# preset's epochs: not measured here (no SQuAD-sized data in the repository).
SMALL_WIDTH, BASE_WIDTH = 256, 768
# task: ((lr, epochs) at hidden <= SMALL_WIDTH, (lr, epochs) at hidden >= BASE_WIDTH), each
# task's own (`popbert.tasks.Task.size_defaults`).
SIZE_DEFAULTS: dict[str, tuple[tuple[float, int], tuple[float, int]]] = {
    name: task.size_defaults for name, task in TASKS.items()}
# What names each of them (a key a --config file or an override sets is the user's choice).
SIZE_DEFAULT_KEYS = {"lr": "optimizer.lr", "epochs": "finetune.epochs"}


def finetune_defaults(task: str, model: BertConfig) -> tuple[float, int]:
    """The fine-tuning learning rate and epochs for a checkpoint of this `model` (its
    `hidden_size`): `SIZE_DEFAULTS`' small values at `SMALL_WIDTH` and narrower, BERT-Base's at
    `BASE_WIDTH` and wider, log-linear in the width between (the rate to 2 significant
    digits)."""
    (small_lr, small_epochs), (base_lr, base_epochs) = SIZE_DEFAULTS[task]
    width = max(SMALL_WIDTH, min(BASE_WIDTH, model.hidden_size))
    t = math.log(width / SMALL_WIDTH) / math.log(BASE_WIDTH / SMALL_WIDTH)
    lr = float(f"{small_lr * (base_lr / small_lr) ** t:.2g}")
    return lr, round(small_epochs + (base_epochs - small_epochs) * t)


def checkpoint_model(checkpoint: str | Path) -> BertConfig:
    """A checkpoint's model config, from its config.yaml alone (no weight is read)."""
    step_dir = ckpt.find_checkpoint(Path(checkpoint), warn=False)
    if not (step_dir / "config.yaml").is_file():
        raise CheckpointError(f"{step_dir / 'config.yaml'}: missing from the checkpoint")
    return load_config(step_dir / "config.yaml").model


def _named_in_file(config: str | Path, task: str) -> set[str]:
    """The `SIZE_DEFAULT_KEYS` a user's --config file sets, itself or through a `preset:` it is
    laid over other than the task's own (whose values are BERT-Base's recipe)."""
    return _keys_in_file(config, task) & set(SIZE_DEFAULT_KEYS.values())


def _keys_in_file(config: str | Path, task: str) -> set[str]:
    """Every dotted key a user's --config file sets, itself or through the `preset:` chain it
    is laid over, up to the task's own preset."""
    import yaml

    named: set[str] = set()
    for _ in range(8):  # a chain of files laid over presets, never a cycle of them
        path = Path(config)
        if not path.is_file():
            try:
                path = preset_path(str(config))
            except ConfigError:
                return named  # load_config says what is wrong with it
        if path.resolve() == preset_path(f"finetune-{task}").resolve():
            return named
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            return named  # load_config says what is wrong with it
        if not isinstance(raw, dict):
            return named
        named |= {key for section, values in raw.items() if isinstance(values, dict)
                  for key in _flat_dict(values, str(section))}
        if not raw.get("preset"):
            return named
        config = raw["preset"]
    return named


def finetune_config(task: str, checkpoint: str | Path, train_file: str | Path,
                    eval_file: str | Path | None = None, overrides: Sequence[str] = (),
                    config: str | Path | None = None) -> RunConfig:
    """The config of a fine-tuning run: `config` (default: the task's preset,
    `finetune-squad` or `finetune-classification`) with the run's inputs, under `overrides`
    (`section.key=value`, as `--set`; `finetune.epochs=3`, `optimizer.lr=3e-5`, ...).

    The learning rate and the epochs that neither `overrides` nor a `config` file names are
    chosen for the checkpoint's size (`finetune_defaults`; `finetune.chosen_by_size` lists
    them, and the run says so in one line when it starts)."""
    if task not in FINETUNE_TASKS:
        raise UsageError(f"unknown fine-tuning task {task!r}; expected one of "
                         f"{', '.join(FINETUNE_TASKS)}")
    # Absolute: the run's config.yaml is read later from other directories (export, sweeps,
    # a moved shell), where a path relative to this one would name nothing.
    inputs = {"finetune.task": task, "finetune.checkpoint": os.path.abspath(checkpoint),
              "finetune.train_file": os.path.abspath(train_file)}
    if eval_file is not None:
        inputs["finetune.eval_file"] = os.path.abspath(eval_file)
    parsed = {".".join(path): value for path, value in map(parse_override, overrides)}
    named = set(parsed) | (_named_in_file(config, task) if config is not None else set())
    sized = parsed.get("finetune.checkpoint", checkpoint)  # the one the run will start from
    inputs.update(_checkpoint_model_keys(task, sized if isinstance(sized, (str, Path))
                                         else checkpoint, overrides))
    given = [f"{k}={json.dumps(v)}" for k, v in inputs.items()]
    chosen = _size_defaults(task, sized if isinstance(sized, (str, Path)) else checkpoint,
                            named)  # before the overrides: a user's chosen_by_size wins
    cfg = load_config(config if config is not None else f"finetune-{task}",
                      [*given, *chosen, *overrides])
    if config is not None:
        _refuse_ignored_file_keys(config, cfg, load_config(f"finetune-{task}",
                                                           [*given, *chosen, *overrides]), task)
    return cfg


def _flat(section: Any, prefix: str) -> dict[str, Any]:
    """A config section's values by dotted key (nested sections flattened)."""
    return _flat_dict(dataclasses.asdict(section), prefix)


def _flat_dict(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}.{name}"
        out.update(_flat_dict(value, key) if isinstance(value, dict) else {key: value})
    return out


def _refuse_ignored_file_keys(config: str | Path, cfg: RunConfig, without_file: RunConfig,
                              task: str) -> None:
    """A `--config` file's values that fine-tuning would replace (the model and data of the
    checkpoint, the steps and warm-up it derives) are refused in one line, as `--set` is; a
    file that repeats what the run would use anyway (a dumped config) passes."""
    head = HEAD_KEYS.get(task, ())
    named = _keys_in_file(config, task)
    ours = {**_flat(cfg.model, "model"), **_flat(cfg.data, "data"),
            "training.steps": cfg.training.steps,
            "optimizer.warmup_steps": cfg.optimizer.warmup_steps}
    theirs = {**_flat(without_file.model, "model"), **_flat(without_file.data, "data"),
              "training.steps": without_file.training.steps,
              "optimizer.warmup_steps": without_file.optimizer.warmup_steps}
    for key, value in ours.items():
        if key not in named or key in head or key == "data.strict" or value == theirs.get(key):
            continue
        instead = next((DERIVED_KEYS[k] for k in DERIVED_KEYS
                        if key == k or key.startswith(k + ".")), None)
        why = (f"fine-tuning sets {key} from {instead}" if instead is not None else
               f"fine-tuning takes {key.split('.')[0]}.* from finetune.checkpoint")
        raise ConfigError(f"--config {config}: {key}: {json.dumps(value)} would do nothing: "
                          f"{why}; leave it out of the file")


# The keys a fine-tuning run takes from elsewhere than its own config: `--set` naming one would
# be accepted and do nothing, so it is refused, saying what sets it instead.
DERIVED_KEYS = {"training.steps": "finetune.epochs (the steps are epochs x batches)",
                "optimizer.warmup_steps": "finetune.warmup_proportion",
                "model.sequence_length": "finetune.max_seq_length (--max-seq-length)",
                "model.hidden_dropout": "finetune.dropout (--dropout)",
                "model.attention_dropout": "finetune.dropout (--dropout)",
                "model.task": "the task's flags (--labels, --doc-stride, ...)"}
# The model keys that do take effect in fine-tuning: how a task's new head is made (a
# classifier's pooling).
HEAD_KEYS = {name: task.head_keys for name, task in TASKS.items()}


def _checkpoint_model_keys(task: str, checkpoint: str | Path,
                           overrides: Sequence[str]) -> dict[str, Any]:
    """Refuse (one line) each override that fine-tuning would override with the checkpoint's
    config or derive itself; the model keys that set the new head (`HEAD_KEYS`) are laid over
    the checkpoint's. Returns the checkpoint's family (and head settings) as inputs, so the
    config's family sections are checked against the checkpoint's model."""
    try:
        model = checkpoint_model(checkpoint)
    except (CheckpointError, ConfigError, OSError):
        return {}  # the run says what is wrong with the checkpoint where it always has
    family = FAMILIES[model.architecture]
    head = HEAD_KEYS.get(task, ())
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key in head and key.startswith(f"model.{model.architecture}."):
            continue
        derived = next((DERIVED_KEYS[k] for k in DERIVED_KEYS
                        if key == k or key.startswith(k + ".")), None)
        if derived is not None:
            raise ConfigError(f"--set {text}: fine-tuning sets {key} from {derived}; set that "
                              "instead")
        if key.startswith(("model.", "data.")) and key != "data.strict":
            can = (f"; of the model, fine-tuning sets {', '.join(head)} (the new head)"
                   if head and model.architecture == "modernbert" else "")
            raise ConfigError(f"--set {text}: fine-tuning takes {key.split('.')[0]}.* from "
                              f"finetune.checkpoint (a {family.title}, model.architecture "
                              f"{model.architecture}): {key} would do nothing{can}")
    inputs: dict[str, Any] = {"model.architecture": model.architecture,
                              "model.next_sentence_prediction": model.next_sentence_prediction}
    if model.architecture == "modernbert":
        inputs["model.modernbert.classifier_pooling"] = model.modernbert.classifier_pooling
    return inputs


def _size_defaults(task: str, checkpoint: str | Path, named: set[str]) -> list[str]:
    """Overrides for the learning rate and epochs `named` lacks, chosen for the checkpoint's
    size, and `finetune.chosen_by_size` naming them (the job says so when the run starts). A
    checkpoint that cannot be read chooses nothing here: the run says what is wrong with it
    where it always has."""
    missing = {flag: key for flag, key in SIZE_DEFAULT_KEYS.items() if key not in named}
    chosen: dict[str, Any] = {}
    if missing:
        try:
            lr, epochs = finetune_defaults(task, checkpoint_model(checkpoint))
        except (CheckpointError, ConfigError, OSError):
            missing = {}
        else:
            chosen = {key: {"lr": lr, "epochs": epochs}[flag] for flag, key in missing.items()}
    return [f"{key}={json.dumps(value)}" for key, value in chosen.items()] + [
        f"finetune.chosen_by_size={json.dumps(list(missing))}"]


@dataclass
class Pretrained:
    """What fine-tuning starts from: the run config, the weights and the vocabulary."""

    config: RunConfig
    weights: dict[str, torch.Tensor]
    vocab: Path
    lowercase: bool
    step_dir: Path


def load_pretrained(checkpoint: Path) -> Pretrained:
    """A checkpoint's weights, config and vocabulary (one-line errors for what is missing)."""
    restored = ckpt.load_checkpoint(checkpoint, weights_only=True)
    step_dir = ckpt.find_checkpoint(checkpoint)
    cfg = config_from_dict(restored.config, source=str(step_dir / "config.yaml"))
    vocab = checkpoint_vocab(checkpoint, cfg.data.vocab_file)
    if vocab is None:
        raise CheckpointError(f"{checkpoint}: its vocabulary {cfg.data.vocab_file} is gone "
                              f"and there is no {VOCAB} in the run directory")
    entries = load_tokenizer(vocab, cfg.model.task.lowercase).vocab_size
    if entries > cfg.model.vocab_size:
        raise CheckpointError(f"{vocab}: {entries} vocabulary entries but the checkpoint's "
                              f"model.vocab_size is {cfg.model.vocab_size}")
    return Pretrained(cfg, restored.weights, vocab, cfg.model.task.lowercase, step_dir)


def task_model_config(model: BertConfig, sequence_length: int, task: TaskConfig,
                      dropout: float | None = None) -> BertConfig:
    """The checkpoint's model at `sequence_length` for one process (no placement, unpacked),
    with the fine-tuning `task` settings in place of the checkpoint's, and `dropout` for both
    dropouts if given — else the family's fine-tuning dropout where it has one (GroupBERT
    pre-trains without dropout and fine-tunes with 0.1), else the checkpoint's."""
    if sequence_length > model.max_position_embeddings:
        raise UsageError(f"finetune.max_seq_length ({sequence_length}) exceeds the checkpoint's "
                         f"model.max_position_embeddings ({model.max_position_embeddings})")
    values = {**model.__dict__, "sequence_length": sequence_length, "layers_per_ipu": None,
              "recompute": False, "dialect": "onnx",
              "max_predictions_per_seq": min(model.max_predictions_per_seq, sequence_length),
              "task": task}
    if dropout is None:
        dropout = family_of(model).finetune_dropout
    if dropout is not None:
        values["hidden_dropout"] = values["attention_dropout"] = dropout
    if "packed" in values:  # fine-tuning features are one sequence per row
        values["packed"] = False
    return BertConfig(**values)


def head_settings(cfg: RunConfig, task: str, model: BertConfig) -> BertConfig:
    """`model` with the settings of the new head `cfg` gives (the task's `head_keys`: a
    ModernBERT classifier's pooling), when `cfg` describes the checkpoint's family
    (`finetune_config` gives it the checkpoint's family and values, and lays `--set` over
    them)."""
    if cfg.model.architecture != model.architecture:
        return model
    for key in TASKS[task].head_keys:
        section, name = key.split(".")[1:]  # model.<family section>.<name>
        if section != model.architecture:
            continue
        ours, theirs = getattr(cfg.model, section), getattr(model, section)
        if getattr(ours, name) != getattr(theirs, name):
            log.info("%s head: %s %s (the checkpoint's is %s)", task, key,
                     getattr(ours, name), getattr(theirs, name))
        model = dataclasses.replace(model, **{section: dataclasses.replace(
            theirs, **{name: getattr(ours, name)})})
    return model


def _row_lengths(mask: np.ndarray) -> np.ndarray:
    """Each row's real tokens: of its longest text for rows of several texts."""
    return mask.reshape(len(mask), -1, mask.shape[-1]).sum(axis=-1).max(axis=-1)


def batches_per_epoch(examples: int, micro_batch_size: int, replicas: int = 1) -> int:
    """Global batches in one pass over `examples`: the last may be short in one process; across
    replicas it is left out (every replica takes a full micro-batch of each global batch, as
    `DistributedSampler(drop_last=True)` does), so one needs at least one full global batch."""
    if replicas == 1:
        return math.ceil(examples / micro_batch_size)
    if examples < micro_batch_size * replicas:
        raise UsageError(f"{examples} training examples cannot fill one global batch of "
                         f"{replicas} replicas x {micro_batch_size} (--batch-size)")
    return examples // (micro_batch_size * replicas)


class EpochBatches:
    """Shuffled mini-batches of in-memory features, a new order each epoch (the last batch of
    an epoch may be short); resumable by its position. `group_by_length`: each batch's rows of
    similar length (`length_grouped_order`, by `input_mask`), so trimmed batches are short.
    Replica `rank` of `size` takes its share of each global batch of `batch_size` x `size`
    rows (all replicas draw the same order)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, epochs: int,
                 seed: int, group_by_length: bool = False, rank: int = 0, size: int = 1):
        self.arrays = arrays
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed
        self.rank, self.size = rank, size
        self.lengths = (_row_lengths(np.asarray(arrays["input_mask"])) if group_by_length
                        else None)
        self.num_samples = len(next(iter(arrays.values())))
        self.per_epoch = batches_per_epoch(self.num_samples, batch_size, size)
        self.position = 0  # batches served so far
        self._order: tuple[int, np.ndarray] | None = None

    def __iter__(self) -> EpochBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        epoch, index = divmod(self.position, self.per_epoch)
        if epoch >= self.epochs:
            raise StopIteration
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng(self.seed + epoch)
            order = rng.permutation(self.num_samples)
            if self.lengths is not None:
                order = length_grouped_order(order, self.lengths, self.batch_size * self.size,
                                             rng)
            self._order = (epoch, order)
        step = self.batch_size * self.size
        rows = self._order[1][index * step:(index + 1) * step]
        rows = rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.position += 1
        return {k: torch.from_numpy(v[rows]) for k, v in self.arrays.items()}

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"the checkpoint's data has {state['num_samples']} examples, this "
                             f"run's {self.num_samples}")
        self.position = int(state["position"])


class FinetuneJob(Job):
    """A fine-tuning run of one task (`popbert.tasks`): the checkpoint it starts from, the
    config it derives from it, the task's data (read by the task), the stateless loader over
    those in-memory features, the weights-only checkpoint and the task's score at the end."""

    def __init__(self, cfg: RunConfig, output_dir: Path):
        self.check(cfg)  # before the checkpoint and the data are read
        f = cfg.finetune
        self.spec: Task = TASKS[f.task]
        self.task = self.spec.name
        self.metric_keys = self.spec.metric_keys
        self.final_metrics = self.spec.final_metrics  # what `score` returns
        self.output_dir = Path(output_dir)
        self.pretrained = load_pretrained(Path(f.checkpoint))
        self.max_seq_length = f.max_seq_length or self.spec.default_max_seq_length
        family = self.pretrained.config.model.architecture
        model = self.pretrained.config.model
        self.data: TaskData = self.spec.read(cfg, Setting(
            self.pretrained.vocab, self.pretrained.lowercase, self.max_seq_length, family,
            self.spec.hf_architecture(family), model.hidden_size, model.task))
        self.arrays = self.data.arrays
        examples = len(next(iter(self.arrays.values())))
        steps = f.epochs * batches_per_epoch(examples, cfg.execution.micro_batch_size,
                                             cfg.execution.replicas)
        model = head_settings(cfg, self.task, task_model_config(
            self.pretrained.config.model, self.max_seq_length, self.data.task_config(),
            f.dropout))
        super().__init__(self.resolve(cfg, model, steps))
        self.name = f"finetune {self.task}"
        log.info("%s: %d training examples of %d tokens; %d steps", self.task, examples,
                 self.max_seq_length, steps)
        self.say_chosen_by_size()

    def say_chosen_by_size(self) -> None:
        """One line on the learning rate and epochs chosen for the checkpoint's size
        (`finetune.chosen_by_size`), and how to choose them."""
        chosen = self.config.finetune.chosen_by_size
        if not chosen:
            return
        values = {"lr": f"lr {self.config.optimizer.lr:g}",
                  "epochs": f"epochs {self.config.finetune.epochs}"}
        parameters = sum(w.numel() for w in self.pretrained.weights.values())
        log.info("%s: %s for a checkpoint of hidden size %d (%.3gM parameters); %s to choose",
                 ", ".join(values[name] for name in chosen),
                 "defaults" if len(chosen) > 1 else "the default",
                 self.pretrained.config.model.hidden_size, parameters / 1e6,
                 "/".join(f"--{name}" for name in chosen))

    def resolve(self, cfg: RunConfig, model: BertConfig, steps: int) -> RunConfig:
        """The run's config: the checkpoint's model (with the task head) and data (with the
        run's own vocabulary), its tracking unless this config names one, and the step count and
        warmup derived from the epochs."""
        base = self.pretrained.config
        values = cfg.to_dict()
        values["model"] = dataclasses.asdict(model)
        values["data"] = {**dataclasses.asdict(base.data),
                          "vocab_file": str(self.output_dir.resolve() /
                                            tokenizer_file_name(self.pretrained.vocab)),
                          "strict": cfg.data.strict}  # what read() read the files with
        if cfg.tracking.backend == "none":
            values["tracking"] = dataclasses.asdict(base.tracking)
        values["training"] = {**values["training"], "steps": steps}
        values["optimizer"] = {**values["optimizer"],
                               "warmup_steps": int(cfg.finetune.warmup_proportion * steps)}
        return config_from_dict(values, source=f"fine-tuning {self.task} from "
                                               f"{self.pretrained.step_dir}")

    def check(self, cfg: RunConfig) -> None:
        e = cfg.execution
        if e.pipeline or e.replicated_tensor_sharding or e.backend != "torch":
            raise ConfigError("fine-tuning runs on data-parallel replicas of the whole model on "
                              "the torch backend: set execution.pipeline=false, "
                              "execution.replicated_tensor_sharding=false, "
                              "execution.backend=torch")

    def check_resume(self, restored: ckpt.Checkpoint) -> None:
        raise ConfigError("fine-tuning checkpoints hold weights only and do not resume: start "
                          "the fine-tuning run again")

    def loader(self, rank: int, size: int) -> EpochBatches:
        c = self.config
        return EpochBatches(self.arrays, c.execution.micro_batch_size, c.finetune.epochs,
                            c.training.seed, c.finetune.group_by_length, rank, size)

    def load_initial_weights(self, session: Session,
                             weights: dict[str, torch.Tensor] | None) -> list[str]:
        """The checkpoint's weights (a shape that differs is an error); the head starts fresh."""
        weights = weights if weights is not None else self.pretrained.weights
        params = dict(session.named_parameters)
        for name, value in weights.items():
            if name in params and tuple(value.shape) != tuple(params[name].shape):
                raise CheckpointError(f"checkpoint weight {name} has shape "
                                      f"{tuple(value.shape)}, the {self.task} graph needs "
                                      f"{tuple(params[name].shape)}")
        session.load_weights({k: v for k, v in weights.items() if k in params}, strict=False)
        fresh = [name for name in params if name not in weights]
        if fresh:
            log.info("initialised fresh (not in the checkpoint): %s", ", ".join(fresh))
        return fresh

    def write_inputs(self, output_dir: Path) -> None:
        vocab = self.pretrained.vocab
        stored = output_dir / tokenizer_file_name(vocab)
        if vocab.resolve() != stored.resolve():
            atomic_write_bytes(stored, vocab.read_bytes())

    def graph_to_save(self) -> None:
        return None  # rebuilt from config.yaml (export, export-hf): a copy would double the size

    def checkpoint_state(self, trainer: Any) -> dict[str, Any]:
        session = trainer.session
        return {"session": {"step": session.step, "weights": session.weights()}}

    def infer(self, trainer: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        c = self.config
        return infer(c.model, self.task, trainer.session.weights(), arrays,
                     c.finetune.eval_batch_size, c.execution.device)

    def score(self, trainer: Any) -> dict[str, float]:
        """The task's score of the trained weights (and what it writes beside them)."""
        return self.data.score(lambda arrays: self.infer(trainer, arrays), trainer.output_dir)




def finetune_job(cfg: RunConfig, output_dir: Path) -> FinetuneJob:
    """The fine-tuning job `cfg.finetune` describes, its data read and its config resolved."""
    f = cfg.finetune
    f.check_inputs()
    checkpoint = Path(f.checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"finetune.checkpoint: not a directory: {checkpoint}")
    return FinetuneJob(cfg, output_dir)


def infer(model: BertConfig, task: str, weights: Mapping[str, torch.Tensor],
          arrays: Mapping[str, np.ndarray], batch_size: int, device: str
          ) -> dict[str, np.ndarray]:
    """The task graph's outputs (no dropout) for all rows of `arrays`, in batches of rows of
    similar length, each cut to its longest (`popbert.runtime.buckets`; a popart-dialect or
    packed graph, which has a fixed length, in input order at full length): the padded
    batches' outputs without computing their padding."""
    cut = model.dialect == "onnx" and not model.packed  # what takes a symbolic length
    graph = build_bert(model, task=task, with_loss=False, zeros=True, dynamic_sequence=cut)
    session = InferenceSession(graph.model(), SessionOptions(device=device))
    session.load_weights(weights, strict=False)

    # Outputs fetched only on request (an embedding's per-token states) would hold [rows,
    # length, hidden] for a whole evaluation corpus; no score reads them.
    skipped = set(task_named(task).on_request_outputs)

    def run_batch(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = session.run({k: torch.from_numpy(v) for k, v in feeds.items()})
        return {k: v.float().cpu().numpy() for k, v in outputs.items() if k not in skipped}

    outputs, _ = run_by_length(run_batch, arrays, batch_size,
                               inputs=("input_ids", "segment_ids", "input_mask"),
                               per_token=task_named(task).per_token_outputs, bucket=cut,
                               cut=cut, desc=f"evaluate {task}")
    return outputs


__all__ = ["COMMON_FLAGS", "FLAG_KEYS", "GROUPBERT_FINETUNE_DROPOUT", "PATH_FLAGS",
           "RUN_FLAG_KEYS", "SIZE_DEFAULTS", "EpochBatches", "FinetuneJob", "Pretrained",
           "batches_per_epoch", "finetune_config", "finetune_defaults", "finetune_job", "infer",
           "load_pretrained", "task_flags", "task_model_config"]

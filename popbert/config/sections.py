"""The sections of a run config as dataclasses, and the checks a whole config must pass.

A run is described by the sections `model`, `data`, `optimizer`, `execution`, `training` and
`tracking`, plus the name of the `preset` it was laid over. Every value is checked here, before
any model is built, so an impossible setting fails in a second with a one-line `ConfigError`
naming the key and where its value came from, instead of an obscure error hours into a run.
Reading YAML, presets and `--set` overrides live in `popbert.config.loading`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from popbert.builders.bert_config import BertConfig
from popbert.dtypes import FLOAT_FORMATS
from popbert.errors import ConfigError

logger = logging.getLogger(__name__)

OPTIMIZERS = ("lamb", "adamw")
DECAYS = ("linear", "polynomial", "none")
LOSS_SCALINGS = ("none", "static", "dynamic")
BACKENDS = ("torch", "popart")
DEVICES = ("cpu", "cuda", "auto")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
TRACKERS = ("none", "wandb")


@dataclass
class DataConfig:
    """Where the pre-training data comes from and how instances are generated from text."""

    # Globs of HDF5 shards or text files; empty = the corpus bundled with popbert.data.
    input_files: list[str] = field(default_factory=list)
    vocab_file: str | None = None  # None = the bundled WordPiece vocabulary
    seed: int = 12345
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    duplication_factor: int = 1
    whole_word_masking: bool = False
    shuffle: bool = True
    # Held-out data for `training.eval_every`: files in input_files' formats, or (text corpora
    # only) a fraction of the corpus's documents, held out by document so that no sentence of a
    # held-out article is trained on. Empty and 0: no validation data.
    validation_files: list[str] = field(default_factory=list)
    validation_fraction: float = 0.0


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule and loss scaling (Graphcore's LAMB settings by default)."""

    name: str = "lamb"
    lr: float = 0.001
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    # Graphcore ships LAMB without bias correction (popart.AdamMode.LambNoBias).
    bias_correction: bool = False
    max_grad_norm: float | None = None
    warmup_steps: int = 0
    warmup_start_lr: float = 1e-7
    decay: str = "linear"
    end_lr: float = 1e-7
    power: float = 1.0
    # Graphcore's piecewise-constant schedule "step:lr,step:lr,..."; replaces warmup/decay.
    lr_schedule: str | None = None
    loss_scaling: str = "none"
    loss_scale: float = 1.0  # the static scale, or the initial scale when dynamic
    max_trust_ratio: float | None = None


@dataclass
class ExecutionConfig:
    """How and where the graph runs: backend, device, batch layout, precision."""

    backend: str = "torch"
    device: str = "auto"
    micro_batch_size: int = 32
    gradient_accumulation: int = 1
    replicas: int = 1
    device_iterations: int = 1
    weight_dtype: str = "float32"
    compute_dtype: str = "float32"
    stochastic_rounding: bool | None = None  # None = on exactly when weights are half precision
    compile: bool = False
    pipeline: bool = False
    replicated_tensor_sharding: bool = False
    pipeline_schedule: str = "1f1b"  # or "gpipe" (execution.pipeline)
    recompute: bool = False
    threads: int | None = None  # torch intra-op threads; None = torch's default

    @property
    def use_stochastic_rounding(self) -> bool:
        """Whether weight updates are stochastically rounded (resolves the None default)."""
        if self.stochastic_rounding is None:
            return self.weight_dtype != "float32"
        return self.stochastic_rounding


@dataclass
class TrainingConfig:
    """Length of the run, batch size check, checkpoint and log cadence."""

    steps: int = 1000
    # None = derived: micro_batch_size x replicas x gradient_accumulation.
    global_batch_size: int | None = None
    checkpoint_every: int = 0  # 0 = only at the end
    # Checkpoints kept besides the final one (the newest); 0 keeps every checkpoint.
    keep_checkpoints: int = 3
    # Stop when the loss exceeds this multiple of the first step's (at least 1.0): a run that
    # blew up, even if its numbers stay finite. 0 = only a non-finite loss stops the run.
    divergence_factor: float = 100.0
    log_every: int = 10
    seed: int = 42
    # Evaluate on the validation data every this many steps (0 = never), over the same
    # `eval_batches` micro-batches (per replica) each time.
    eval_every: int = 0
    eval_batches: int = 8


@dataclass
class TrackingConfig:
    """Where metrics go besides `metrics.jsonl`."""

    backend: str = "none"
    project: str = "popbert"
    run_name: str | None = None
    # W&B run group: the runs of one sweep share it (the sweep's id), so they are compared together.
    group: str | None = None
    # Upload the run's final checkpoint to W&B as a "model" artifact.
    log_checkpoint: bool = False


@dataclass
class FinetuneConfig:
    """A fine-tuning run: the checkpoint it starts from, its task data and the task's own knobs.

    `task: null` is a pre-training run (the other keys are then unused). The task head's
    settings that export needs (window sizes, labels, lowercasing) live in `model.task`; these
    keys are the run's inputs. `training.steps` of a fine-tuning run is derived from `epochs`
    and the number of training examples, `optimizer.warmup_steps` from `warmup_proportion`.
    """

    task: str | None = None  # squad | classification
    checkpoint: str | None = None  # a popbert checkpoint or run directory (pre-trained, imported)
    train_file: str | None = None
    # SQuAD: the file to predict (and score when it has answers); classification: the file
    # scored after training (the training file when null).
    eval_file: str | None = None
    epochs: int = 2
    warmup_proportion: float = 0.1
    max_seq_length: int | None = None  # null: 384 for SQuAD, 128 for classification
    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = 20
    max_answer_length: int = 30
    text_column: str | None = None
    pair_column: str | None = None
    label_column: str = "label"
    labels: list[str] | None = None  # null: the training file's labels, sorted
    eval_batch_size: int = 64
    dropout: float | None = None  # hidden and attention dropout; null: the checkpoint's


SECTIONS: dict[str, type] = {
    "model": BertConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "execution": ExecutionConfig,
    "training": TrainingConfig,
    "tracking": TrackingConfig,
    "finetune": FinetuneConfig,
}

# The top-level keys of a config file: the preset it is laid over, then the sections.
TOP_LEVEL_KEYS = ("preset", *SECTIONS)


@dataclass
class RunConfig:
    """A whole run: one dataclass per YAML section, and the preset the file was laid over.

    `preset` is a record of where the values not given in the file came from (None: from the
    dataclass defaults); every section holds the resolved values, so a saved config never
    depends on the preset files of the popbert version that reads it back.
    """

    preset: str | None = None
    model: BertConfig = field(default_factory=BertConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch x replicas x gradient accumulation."""
        e = self.execution
        return e.micro_batch_size * e.replicas * e.gradient_accumulation

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready) that `config_from_dict` turns back into an equal
        config: `preset`, then one mapping per section (`finetune` only for a fine-tuning
        run: a pre-training config reads as it always did)."""
        return {"preset": self.preset,
                **{name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS
                   if name != "finetune" or self.finetune.task is not None}}

    def validate(self, source: str = "<config>") -> None:
        """Check values and cross-section consistency; raise ConfigError naming the key."""
        validate_run_config(self, source)


def parse_lr_schedule(spec: str) -> list[tuple[int, float]]:
    """Parse Graphcore's piecewise-constant schedule "step:lr,step:lr" (steps increasing).

    From each listed step on, the learning rate is the listed value until the next entry.
    Raises ValueError on malformed text.
    """
    entries: list[tuple[int, float]] = []
    for part in spec.split(","):
        part = part.strip()
        step_s, sep, lr_s = part.partition(":")
        if not sep:
            raise ValueError(f"entry {part!r} is not step:lr")
        try:
            step, lr = int(step_s), float(lr_s)
        except ValueError:
            raise ValueError(f"entry {part!r} is not step:lr") from None
        if step < 0 or not 0 <= lr < math.inf:
            raise ValueError(f"entry {part!r} needs step >= 0 and a finite lr >= 0")
        if entries and step <= entries[-1][0]:
            raise ValueError(f"steps must increase, got {step} after {entries[-1][0]}")
        entries.append((step, lr))
    return entries


def non_finite(value: Any, key: str) -> tuple[str, float] | None:
    """The first infinite or NaN float in `value` (nested lists, mappings, dataclasses) as
    (its dotted key, the value); None when every number is finite.

    An infinite learning rate or a NaN dropout passes every `> 0` style range check, and then
    ruins a run silently; rejecting them everywhere is simpler than a check per key.
    """
    for path, item in _leaves(value, key):
        if isinstance(item, float) and not math.isfinite(item):
            return path, item
    return None


def _leaves(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{key}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{key}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, value


class _Checker:
    """Raises ConfigError naming the key and where its value came from (file or --set)."""

    def __init__(self, source: str, key_sources: dict[str, str]) -> None:
        self.source = source
        self.key_sources = key_sources

    def where(self, key: str | None) -> str:
        """The origin of `key` (its --set override, or the file), or of the whole config."""
        key = re.sub(r"\[\d+\]", "", key or "")  # optimizer.betas[1] came with optimizer.betas
        while key:
            if key in self.key_sources:
                return self.key_sources[key]
            key = key.rpartition(".")[0]
        return self.source

    def __call__(self, ok: bool, key: str | None, message: str) -> None:
        if not ok:
            raise ConfigError(f"{self.where(key)}: {message}")

    def enum(self, key: str, value: str, allowed: tuple[str, ...]) -> None:
        self(value in allowed, key, f"{key}: expected one of {', '.join(allowed)}, got {value!r}")


def validate_run_config(cfg: RunConfig, source: str = "<config>",
                        key_sources: dict[str, str] | None = None) -> None:
    """Check every value and the consistency between sections.

    Raises a one-line ConfigError that starts with where the offending value came from:
    `key_sources` maps a dotted key to its origin (e.g. "--set optimizer.lr=0"), anything else
    is blamed on `source`.
    """
    check = _Checker(source, key_sources or {})
    for name in SECTIONS:
        bad = non_finite(getattr(cfg, name), name)
        if bad is not None:
            check(False, bad[0], f"{bad[0]} must be a finite number, got {bad[1]}")
    try:
        cfg.model.validate()
    except ValueError as exc:
        # Blame the first key the message names that came from an override, if any.
        named = [k for k in re.findall(r"model(?:\.\w+)+", str(exc))
                 if check.where(k) != check.source]
        raise ConfigError(f"{check.where(named[0] if named else None)}: {exc}") from None

    d = cfg.data
    check(0.0 < d.masked_lm_prob <= 1.0, "data.masked_lm_prob",
          f"data.masked_lm_prob must be in (0, 1], got {d.masked_lm_prob}")
    check(0.0 <= d.short_seq_prob <= 1.0, "data.short_seq_prob",
          f"data.short_seq_prob must be in [0, 1], got {d.short_seq_prob}")
    check(d.duplication_factor >= 1, "data.duplication_factor",
          f"data.duplication_factor must be >= 1, got {d.duplication_factor}")
    check(0.0 <= d.validation_fraction < 1.0, "data.validation_fraction",
          f"data.validation_fraction must be in [0, 1) (0 = none held out), "
          f"got {d.validation_fraction}")
    check(not (d.validation_fraction and d.validation_files), "data.validation_fraction",
          "data.validation_fraction and data.validation_files both given; choose one")
    check(not d.validation_fraction
          or not any(f.lower().endswith((".h5", ".hdf5")) for f in d.input_files),
          "data.validation_fraction",
          "data.validation_fraction holds out documents of a text corpus, but "
          "data.input_files are HDF5 shards (instances, not documents); give held-out shards "
          "in data.validation_files")

    o = cfg.optimizer
    check.enum("optimizer.name", o.name, OPTIMIZERS)
    check.enum("optimizer.decay", o.decay, DECAYS)
    check.enum("optimizer.loss_scaling", o.loss_scaling, LOSS_SCALINGS)
    check(o.lr > 0, "optimizer.lr", f"optimizer.lr must be > 0, got {o.lr}")
    check(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "optimizer.betas",
          f"optimizer.betas must be two values in [0, 1), got {o.betas}")
    check(o.eps > 0, "optimizer.eps", f"optimizer.eps must be > 0, got {o.eps}")
    check(o.weight_decay >= 0, "optimizer.weight_decay",
          f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    check(o.max_grad_norm is None or o.max_grad_norm > 0, "optimizer.max_grad_norm",
          f"optimizer.max_grad_norm must be > 0 or null, got {o.max_grad_norm}")
    check(o.warmup_steps >= 0, "optimizer.warmup_steps",
          f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps}")
    check(o.warmup_start_lr >= 0, "optimizer.warmup_start_lr",
          f"optimizer.warmup_start_lr must be >= 0, got {o.warmup_start_lr}")
    check(o.end_lr >= 0, "optimizer.end_lr", f"optimizer.end_lr must be >= 0, got {o.end_lr}")
    check(o.power > 0, "optimizer.power", f"optimizer.power must be > 0, got {o.power}")
    check(o.loss_scale > 0, "optimizer.loss_scale",
          f"optimizer.loss_scale must be > 0, got {o.loss_scale}")
    check(o.max_trust_ratio is None or o.max_trust_ratio > 0, "optimizer.max_trust_ratio",
          f"optimizer.max_trust_ratio must be > 0 or null, got {o.max_trust_ratio}")
    if o.lr_schedule is not None:
        try:
            parse_lr_schedule(o.lr_schedule)
        except ValueError as exc:
            check(False, "optimizer.lr_schedule", f"optimizer.lr_schedule {o.lr_schedule!r}: {exc}")

    e = cfg.execution
    check.enum("execution.backend", e.backend, BACKENDS)
    check.enum("execution.device", e.device, DEVICES)
    check.enum("execution.weight_dtype", e.weight_dtype, FLOAT_FORMATS)
    check.enum("execution.compute_dtype", e.compute_dtype, FLOAT_FORMATS)
    check.enum("execution.pipeline_schedule", e.pipeline_schedule, PIPELINE_SCHEDULES)
    for key in ("micro_batch_size", "gradient_accumulation", "replicas", "device_iterations"):
        value = getattr(e, key)
        check(value >= 1, f"execution.{key}", f"execution.{key} must be >= 1, got {value}")
    check(e.threads is None or e.threads >= 1, "execution.threads",
          f"execution.threads must be >= 1 or null, got {e.threads}")
    check(not e.pipeline or cfg.model.layers_per_ipu is not None, "execution.pipeline",
          "execution.pipeline needs model.layers_per_ipu (the layers of each pipeline stage)")
    check(e.backend != "popart" or cfg.model.dialect == "popart", "execution.backend",
          f"execution.backend 'popart' needs model.dialect 'popart' "
          f"(PopART reads ai.onnx opset 11), got {cfg.model.dialect!r}")

    t = cfg.training
    check(t.steps >= 1, "training.steps", f"training.steps must be >= 1, got {t.steps}")
    check(t.checkpoint_every >= 0, "training.checkpoint_every",
          f"training.checkpoint_every must be >= 0 (0 = only at the end), "
          f"got {t.checkpoint_every}")
    check(t.keep_checkpoints >= 0, "training.keep_checkpoints",
          f"training.keep_checkpoints must be >= 0 (0 keeps all), got {t.keep_checkpoints}")
    check(t.divergence_factor == 0 or t.divergence_factor > 1, "training.divergence_factor",
          f"training.divergence_factor must be 0 (off) or > 1, got {t.divergence_factor}")
    check(t.log_every >= 1, "training.log_every",
          f"training.log_every must be >= 1, got {t.log_every}")
    check(t.eval_every >= 0, "training.eval_every",
          f"training.eval_every must be >= 0 (0 = no evaluation), got {t.eval_every}")
    check(t.eval_batches >= 1, "training.eval_batches",
          f"training.eval_batches must be >= 1, got {t.eval_batches}")
    check(not t.eval_every or bool(d.validation_files) or d.validation_fraction > 0,
          "training.eval_every",
          f"training.eval_every is {t.eval_every} but there is no validation data: set "
          f"data.validation_files or data.validation_fraction (e.g. 0.02)")
    if t.global_batch_size is not None:
        per_pass = e.micro_batch_size * e.replicas
        layout = (f"execution.micro_batch_size ({e.micro_batch_size}) x execution.replicas "
                  f"({e.replicas})")
        check(t.global_batch_size >= 1, "training.global_batch_size",
              f"training.global_batch_size must be >= 1 or null, got {t.global_batch_size}")
        check(t.global_batch_size % per_pass == 0, "training.global_batch_size",
              f"training.global_batch_size ({t.global_batch_size}) is not divisible by "
              f"{layout} = {per_pass}")
        check(t.global_batch_size == cfg.global_batch_size, "training.global_batch_size",
              f"training.global_batch_size ({t.global_batch_size}) != {layout} x "
              f"execution.gradient_accumulation ({e.gradient_accumulation}) = "
              f"{cfg.global_batch_size}; set execution.gradient_accumulation="
              f"{t.global_batch_size // per_pass} or training.global_batch_size=null")

    k = cfg.tracking
    check.enum("tracking.backend", k.backend, TRACKERS)
    check(bool(k.project), "tracking.project", "tracking.project must not be empty")

    if o.lr_schedule is None and o.warmup_steps > t.steps:
        logger.warning("optimizer.warmup_steps (%d) exceeds training.steps (%d): the run ends "
                       "before reaching the peak learning rate", o.warmup_steps, t.steps)
    if e.stochastic_rounding and e.weight_dtype == "float32":
        logger.warning("execution.stochastic_rounding has no effect with float32 weights")


__all__ = [
    "BACKENDS", "DECAYS", "DEVICES", "LOSS_SCALINGS", "OPTIMIZERS", "PIPELINE_SCHEDULES",
    "SECTIONS", "TOP_LEVEL_KEYS", "TRACKERS", "BertConfig", "DataConfig", "ExecutionConfig", "FinetuneConfig",
    "OptimizerConfig", "RunConfig", "TrackingConfig", "TrainingConfig", "non_finite",
    "parse_lr_schedule", "validate_run_config",
]

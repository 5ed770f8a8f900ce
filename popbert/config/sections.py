"""The sections of a run config as dataclasses, each with the rules of its own keys.

A run is described by the sections `model`, `data`, `optimizer`, `execution`, `training`,
`tracking` and `finetune`, plus the name of the `preset` it was laid over. Each key's rule sits
on its field (`popbert.rules.setting`); each section's `validate` checks them and its own
cross-key rules, and `validate_run_config` adds the few that span sections. A broken rule is a
one-line `ConfigError` naming the key and where its value came from, before any model is built.
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

from popbert.builders.bert_config import EMBEDDING_LOSSES, POOLINGS, TASK_NAMES, BertConfig
from popbert.dtypes import FLOAT_FORMATS, rounds_stochastically
from popbert.errors import ConfigError
from popbert.rules import (
    EXPECTED,
    EXPORT_DEVICE,
    PER_MACHINE,
    SEED,
    Invalid,
    Rule,
    above,
    at_least,
    check_fields,
    one_of,
    setting,
    within,
)

logger = logging.getLogger(__name__)

# The names each choice may take; the modules that act on them import them from here.
OPTIMIZERS = ("lamb", "adamw", "stableadamw")
DECAYS = ("linear", "polynomial", "none", "cosine", "wsd")
LOSS_SCALINGS = ("none", "static", "dynamic")
BACKENDS = ("torch", "popart")
DEVICES = ("cpu", "cuda", "auto")  # and "cuda:N", one GPU by its index (see DEVICE)
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
TRACKERS = ("none", "wandb")
# The tasks fine-tuning trains are the tasks a checkpoint can be for (`model.task.name`); each
# is a module of `popbert.tasks`, whose table is checked against these names.
FINETUNE_TASKS = TASK_NAMES


def choice(names: tuple[str, ...]) -> Rule:
    """One of `names`, worded as the loader words a wrong type ("key: expected one of ...")."""
    return one_of(names, EXPECTED)


# `execution.device`: one of DEVICES, or a GPU by index ("cuda:1"), as
# `popbert.runtime.devices.resolve_device` reads it (a sweep agent pins its trials that way).
DEVICE = Rule(lambda v: v in DEVICES or re.fullmatch(r"cuda:\d+", v) is not None,
              f"one of {', '.join(DEVICES)}, cuda:N", form=EXPECTED)


class Bytes(int):
    """A size in bytes: a number, or a string with a unit (`20GB`, `512MiB`, `1.5TB`; KB, MB,
    GB, TB count in 1000s, KiB, MiB, GiB, TiB in 1024s). Only a marker for the config's types:
    values are ints."""

    UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

    @classmethod
    def parse(cls, value: Any) -> int:
        """Bytes of `value`; ValueError when it is not a size above 0."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            number, unit = float(value), ""
        elif isinstance(value, str):
            match = re.fullmatch(r"\s*(\d*\.?\d+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", value.lower())
            if match is None or match.group(2) not in cls.UNITS:
                raise ValueError(f"{value!r} is not a size")
            number, unit = float(match.group(1)), match.group(2)
        else:
            raise ValueError(f"{value!r} is not a size")
        if not number > 0:
            raise ValueError(f"{value!r} is not a size above 0")
        return int(number * cls.UNITS[unit])


# Storage option names whose values are credentials (s3fs key/secret/token, gcsfs token, adlfs
# account_key / sas_token / connection_string / client_secret, any backend's password).
SECRET_OPTION = re.compile(r"key|secret|token|passw|credential|connection_string|sas",
                           re.IGNORECASE)


def without_secrets(options: dict[str, Any]) -> dict[str, Any]:
    """`options` less every credential (`SECRET_OPTION`), nested mappings included: what a run
    may write to its config, checkpoints, metrics and trackers."""
    return {key: without_secrets(value) if isinstance(value, dict) else value
            for key, value in options.items()
            if not SECRET_OPTION.search(str(key)) or str(key).endswith("_url")}


@dataclass
class DataConfig:
    """Where the pre-training data comes from and how instances are generated from text."""

    # Globs of HDF5 shards or text files; empty = the corpus bundled with popbert.data.
    input_files: list[str] = field(default_factory=list)
    vocab_file: str | None = None  # None = the bundled WordPiece vocabulary
    seed: int = setting(12345, SEED)
    masked_lm_prob: float = setting(0.15, within("(0, 1]"))
    short_seq_prob: float = setting(0.1, within("[0, 1]"))
    duplication_factor: int = setting(1, at_least(1))
    whole_word_masking: bool = False
    # Mask every batch anew (RoBERTa's dynamic masking) instead of reusing the masks made with
    # the data: over many epochs of a small corpus the model does not see the same masks again.
    dynamic_masking: bool = False
    shuffle: bool = True
    # Held-out data for `training.eval_every`: files in input_files' formats, or (text corpora
    # only) a fraction of the corpus's documents, held out by document so that no sentence of a
    # held-out article is trained on. Empty and 0: no validation data.
    validation_files: list[str] = field(default_factory=list)
    validation_fraction: float = setting(0.0, within("[0, 1)", " (0 = none held out)"))
    # A resumed run continues the original's sample order when its global batch (micro batch x
    # replicas x accumulation) is the same, however it is split; with another global batch the
    # order differs, and the resume is refused unless this is true.
    reorder_on_resume: bool = False
    # Refuse, rather than warn about, a text corpus whose share of [UNK] tokens shows that the
    # vocabulary does not fit it (above 2%).
    strict: bool = False
    # Data on object storage (fsspec URLs in input_files, validation_files, vocab_file:
    # s3://, gs://, az://): options every filesystem gets (endpoint_url, region...).
    # Credentials belong in the storage's own configuration (for S3 the AWS_* variables);
    # given here they are used, but never written to the run's config, checkpoints or logs.
    storage_options: dict = field(default_factory=dict)
    # Where remote shards are copied to be read (None: $POPBERT_CACHE_DIR/shards, else
    # ~/.cache/popbert/shards), and how much it may hold (least recently used go first);
    # instances made from text files are cached in its instances/ folder (never evicted).
    cache_dir: str | None = None
    cache_limit: Bytes = 20 * 10**9  # type: ignore[assignment]

    @property
    def has_validation(self) -> bool:
        return bool(self.validation_files) or self.validation_fraction > 0

    def validate(self) -> None:
        check_fields(self, "data")
        if self.validation_fraction and self.validation_files:
            raise Invalid("data.validation_fraction and data.validation_files both given; "
                          "choose one", "data.validation_fraction", "data.validation_files")
        if self.validation_fraction and any(f.lower().endswith((".h5", ".hdf5"))
                                            for f in self.input_files):
            raise Invalid("data.validation_fraction holds out documents of a text corpus, but "
                          "data.input_files are HDF5 shards (instances, not documents); give "
                          "held-out shards in data.validation_files",
                          "data.validation_fraction", "data.input_files")


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule and loss scaling (Graphcore's LAMB settings by default)."""

    name: str = setting("lamb", choice(OPTIMIZERS))
    lr: float = setting(0.001, above(0))
    betas: list[float] = setting(
        factory=lambda: [0.9, 0.999],
        rule=Rule(lambda b: len(b) == 2 and all(0.0 <= x < 1.0 for x in b), "two values in [0, 1)"))
    eps: float = setting(1e-6, above(0))
    weight_decay: float = setting(0.01, at_least(0))
    # Graphcore ships LAMB without bias correction (popart.AdamMode.LambNoBias).
    bias_correction: bool = False
    max_grad_norm: float | None = setting(None, above(0).or_null())
    warmup_steps: int = setting(0, at_least(0))
    warmup_start_lr: float = setting(1e-7, at_least(0))
    decay: str = setting("linear", choice(DECAYS))
    end_lr: float = setting(1e-7, at_least(0))
    power: float = setting(1.0, above(0))  # (decay: polynomial)
    # decay: wsd holds the peak after warmup and decays linearly over this final fraction of
    # training.steps (never starting before warmup ends); the other decays ignore it.
    decay_fraction: float = setting(0.2, within("(0, 1]"))
    # Graphcore's piecewise-constant schedule "step:lr,step:lr,..."; replaces warmup/decay.
    lr_schedule: str | None = None
    loss_scaling: str = setting("none", choice(LOSS_SCALINGS))
    loss_scale: float = setting(1.0, above(0))  # the static scale, or the initial one if dynamic
    max_trust_ratio: float | None = setting(None, above(0).or_null())

    def validate(self) -> None:
        check_fields(self, "optimizer")
        if self.lr_schedule is not None:
            try:
                parse_lr_schedule(self.lr_schedule)
            except ValueError as exc:
                raise Invalid(f"optimizer.lr_schedule {self.lr_schedule!r}: {exc}",
                              "optimizer.lr_schedule") from None


@dataclass
class ExecutionConfig:
    """How and where the graph runs: backend, device, batch layout, precision."""

    backend: str = setting("torch", choice(BACKENDS))
    device: str = setting("auto", DEVICE)
    micro_batch_size: int = setting(32, at_least(1))
    gradient_accumulation: int = setting(1, at_least(1))
    replicas: int = setting(1, at_least(1))
    device_iterations: int = setting(1, at_least(1))
    weight_dtype: str = setting("float32", choice(FLOAT_FORMATS))
    compute_dtype: str = setting("float32", choice(FLOAT_FORMATS))
    stochastic_rounding: bool | None = None  # None = on exactly when weights are half precision
    compile: bool = False
    pipeline: bool = False
    replicated_tensor_sharding: bool = False
    pipeline_schedule: str = setting("1f1b", choice(PIPELINE_SCHEDULES))  # (execution.pipeline)
    recompute: bool = False
    # torch's intra-op threads; null: torch's default (the machine's cores), or under a
    # container's CPU quota that quota's share for each of torchrun's processes on the machine
    threads: int | None = setting(None, PER_MACHINE.or_null())
    # Cut each micro-batch to its longest row (and MLM slots to the most used), so padding past
    # it is not computed at all: GEMMs included, not only attention (model.dialect onnx, rows
    # not packed; the graph gets a symbolic sequence axis).
    trim_padding: bool = False
    # Gradient caching (GradCache) for an embedding graph: each micro-batch's vectors are made
    # this many rows at a time, the loss over all of them, then each chunk again with its share
    # of their gradient; the gradients of the whole micro-batch with one chunk's activations in
    # memory. null: one pass per micro-batch.
    gradient_cache_rows: int | None = setting(None, at_least(1).or_null())

    @property
    def use_stochastic_rounding(self) -> bool:
        """Whether weight updates are stochastically rounded (resolves the None default)."""
        return rounds_stochastically(self.stochastic_rounding, self.weight_dtype)

    def validate(self) -> None:
        check_fields(self, "execution")


class Seconds(float):
    """A duration in seconds: a number, or a string of amounts with units `h`, `m`, `s`
    (`90s`, `30m`, `2h`, `1h30m`). Only a marker for the config's types: values are floats."""

    UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}

    @classmethod
    def parse(cls, value: Any) -> float:
        """Seconds of `value`; ValueError when it is not a duration."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a duration")
        parts = re.fullmatch(r"\s*((?:\d+(?:\.\d+)?[hms]\s*)+)", value.lower())
        if parts is None:
            raise ValueError(f"{value!r} is not a duration")
        return sum(float(amount) * cls.UNITS[unit]
                   for amount, unit in re.findall(r"(\d+(?:\.\d+)?)([hms])", value.lower()))


@dataclass
class TrainingConfig:
    """Length of the run, batch size check, checkpoint and log cadence."""

    steps: int = setting(1000, at_least(1))
    # None = derived: micro_batch_size x replicas x gradient_accumulation.
    global_batch_size: int | None = setting(None, at_least(1).or_null())
    checkpoint_every: int = setting(0, at_least(0, " (0 = only at the end)"))
    # Checkpoints kept besides the final one (the newest); 0 keeps every checkpoint.
    keep_checkpoints: int = setting(3, at_least(0, " (0 keeps all)"))
    # Stop when the loss exceeds this multiple of the first step's (at least 1.0): a run that
    # blew up, even if its numbers stay finite. 0 = only a non-finite loss stops the run.
    divergence_factor: float = setting(100.0, Rule(lambda v: v == 0 or v > 1, "0 (off) or > 1"))
    log_every: int = setting(10, at_least(1))
    seed: int = setting(42, SEED)
    # `--init-from` naming another family's checkpoint, or carrying over fewer than half of the
    # run's encoder weights (another size's), is refused; true starts from whatever fits.
    allow_partial_init_from: bool = False
    # Evaluate on the validation data every this many steps (0 = never), over the same
    # `eval_batches` micro-batches (per replica) each time.
    eval_every: int = setting(0, at_least(0, " (0 = no evaluation)"))
    eval_batches: int = setting(8, at_least(1))
    # Under a time budget: evaluate each time another 1/eval_points of it is spent, and at its
    # end (0 = not by time), so runs of different speeds are measured at the same seconds.
    # Only when there is validation data (a preset may set it for runs that bring none).
    eval_points: int = setting(0, at_least(0, " (0 = not by time)"))
    # Under a time budget: the evaluations (which the budget leaves out) may take at most this
    # share of it; they are sized to fit before the run trains (fewer batches, then fewer
    # points), from one validation batch timed then. null: 0.25. Above 1: longer than the
    # training itself.
    eval_share: float | None = setting(None, above(0).or_null())
    # Train for this long instead of to `steps` (seconds; `30m`, `2h` on the command line): the
    # run stops when the budget is spent, leaving time for the final checkpoint and export, and
    # the learning-rate schedule is laid over the budget (`steps` then sets its resolution: at a
    # fraction f of the budget the rate is the schedule's at step f x steps). null: no budget.
    time_budget: Seconds | None = setting(None, above(0).or_null())
    # Batch-size warmup (GPT-3; Geiping & Goldstein 2022, "Cramming"): over this fraction of
    # training (of `steps`, or of `time_budget`) the micro-batches per optimizer step grow
    # linearly from 1 to execution.gradient_accumulation, so early training makes more updates
    # per sample. 0 = the full batch from the first step (rule: `warmup_micro_batches`).
    batch_warmup: float = setting(0.0, within("[0, 1)", " (0 = off)"))
    # Sequence-length curriculum (BERT's phase 1 -> 2 within one run, as in "Cramming"):
    # [[until, length], ...] trains on rows of `length` tokens until that fraction of the run
    # (of `steps`, or of `time_budget`), then the next stage, then model.sequence_length. Each
    # full row is cut into rows of `length` with the same tokens per step; MLM-only rows masked
    # anew (model.next_sentence_prediction false, data.dynamic_masking true). [] = off.
    sequence_curriculum: list[list[float]] = setting(factory=list, rule=Rule(
        lambda v: _is_curriculum(v), "a list of [until, length] pairs, until increasing "
        "within (0, 1], length an integer >= 8 increasing"))

    def validate(self) -> None:
        check_fields(self, "training")
        # Lengths are counts: [[0.5, 64]], not the [[0.5, 64.0]] a list of floats reads as.
        self.sequence_curriculum = [[float(until), int(length)]
                                    for until, length in self.sequence_curriculum]


def _is_curriculum(stages: Any) -> bool:
    """[[until, length], ...] with until in (0, 1] and both increasing."""
    if not isinstance(stages, list):
        return False
    previous = (0.0, 0)
    for stage in stages:
        if not (isinstance(stage, list | tuple) and len(stage) == 2):
            return False
        until, length = stage
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in stage) \
                or not float(length).is_integer():  # YAML lists of floats: 16.0 is 16
            return False
        if not (previous[0] < until <= 1 and length >= 8 and length > previous[1]):
            return False
        previous = (until, length)
    return True


@dataclass
class TrackingConfig:
    """Where metrics go besides `metrics.jsonl`."""

    backend: str = setting("none", choice(TRACKERS))
    project: str = setting("popbert", Rule(bool, "a non-empty name"))
    run_name: str | None = None
    # W&B run group: the runs of one sweep share it (the sweep's id), so they are compared together.
    group: str | None = None
    # Upload the run's final checkpoint to W&B as a "model" artifact.
    log_checkpoint: bool = False

    def validate(self) -> None:
        check_fields(self, "tracking")


def _is_origin(origin: object) -> bool:
    """`*`, or an origin as a browser's `Origin` header carries it (a trailing slash or a
    path never matches one, so such a setting would silently allow nothing)."""
    if origin == "*":
        return True
    if not isinstance(origin, str) or not origin.startswith(("http://", "https://")):
        return False
    host = origin.split("://", 1)[1]
    return bool(host) and "/" not in host and not any(c.isspace() for c in host)


@dataclass
class ServeConfig:
    """`popbert serve`: where it listens and what it takes (each key is also a flag of the same
    name). The API key is not a key here: a secret stays out of files (`POPBERT_API_KEY`)."""

    host: str = setting("127.0.0.1", Rule(bool, "a host name or address"))
    port: int = setting(8080, within("[0, 65535]"))
    served_model_name: str | None = None  # None: the export's file stem
    # Tokens (rows x the batch's longest row) in one model run, batched across requests.
    max_batch_tokens: int = setting(16384, at_least(1))
    # How long a batch waits for requests on their way to join it (a lone request: none).
    max_wait_ms: float = setting(5.0, at_least(0))
    # The share of a batch's tokens that may be padding: rows too far apart in length run
    # apart (padding is computed work on a CPU; batching gains little else there).
    max_padding: float = setting(0.1, within("[0, 1]"))
    # Rows in one model run. null: as many as the bounds allow, except for an export with
    # dynamic INT8 (`export --quantize int8`), whose activation scale comes from the whole batch:
    # there 1, so a text's vector never depends on who shared its batch.
    max_batch_rows: int | None = setting(None, at_least(1).or_null())
    max_input_tokens: int | None = setting(None, at_least(3).or_null())  # None: the model's
    # What an embedding route puts before each text whose request names no `prompt_name`, as
    # TEI's --default-prompt-name and --default-prompt: for a model trained with prompts
    # (E5's "query: ", nomic's "search_query: ") behind clients that cannot name one (OpenAI's).
    # One of the export's prompts by name, or the prompt's text; not both. null: none.
    default_prompt_name: str | None = None
    default_prompt: str | None = None
    max_client_batch_size: int = setting(256, at_least(1))  # inputs in one request
    max_concurrent_requests: int = setting(512, at_least(1))  # beyond it: 503, Retry-After
    payload_limit: int = setting(2_000_000, at_least(1))  # request body bytes; beyond it: 413
    # Seconds a client has to send its body (else 408) and to take its answer (else the
    # server gives up on it): a stalled or vanished client frees its place among
    # max_concurrent_requests within this, and the kernel drops its connection within twice
    # this (TCP_USER_TIMEOUT), so a graceful stop is not held up by it.
    client_timeout_s: float = setting(20.0, within("(0, 3600]"))
    # Origins whose web pages may call the server from a browser (CORS), as TEI's
    # --cors-allow-origin: "*" for any, else scheme://host[:port] as a browser sends it.
    # null: none (a browser refuses other origins' answers).
    cors_allow_origin: list[str] | None = setting(None, Rule(
        lambda origins: all(_is_origin(origin) for origin in origins),
        '"*" or origins written as browsers send them: http(s)://host[:port], no path or '
        'trailing slash').or_null())
    workers: int = setting(1, PER_MACHINE)
    # the runtime's intra-op threads per worker; null: the runtime's default with one worker,
    # each worker's share of the CPUs with more (each runtime would take them all)
    threads: int | None = setting(None, PER_MACHINE.or_null())
    # Where the model runs: the CPU (ONNX Runtime, or OpenVINO for an IR), or a GPU, where
    # popbert's torch backend runs the export's ONNX graph at the export's own precision.
    device: str = setting("cpu", EXPORT_DEVICE)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    access_log: bool = False

    def validate(self) -> None:
        check_fields(self, "serve")
        if self.default_prompt_name is not None and self.default_prompt is not None:
            raise Invalid("serve.default_prompt_name and serve.default_prompt: give one (a "
                          "prompt of the export by name, or the text itself), not both",
                          "serve.default_prompt_name", "serve.default_prompt")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise Invalid("serve.ssl_certfile and serve.ssl_keyfile go together: give both "
                          "for TLS, or neither", "serve.ssl_certfile", "serve.ssl_keyfile")


@dataclass
class FinetuneConfig:
    """A fine-tuning run: the checkpoint it starts from, its task data and the task's own knobs.

    `task: null` is a pre-training run (the other keys are then unused). The task head's
    settings that export needs (window sizes, labels, lowercasing) live in `model.task`; these
    keys are the run's inputs. `training.steps` of a fine-tuning run is derived from `epochs`
    and the number of training examples, `optimizer.warmup_steps` from `warmup_proportion`.
    """

    task: str | None = setting(None, one_of(FINETUNE_TASKS).or_null())
    checkpoint: str | None = None  # a popbert checkpoint or run directory (pre-trained, imported)
    train_file: str | None = None
    # SQuAD: the file to predict (and score when it has answers); classification: the file
    # scored after training (the training file when null).
    eval_file: str | None = None
    epochs: int = setting(2, at_least(1))
    warmup_proportion: float = setting(0.1, within("[0, 1]"))
    # null: 384 for SQuAD, 128 for classification
    max_seq_length: int | None = setting(None, at_least(8).or_null())
    doc_stride: int = setting(128, at_least(1))
    max_query_length: int = setting(64, at_least(1))
    n_best_size: int = setting(20, at_least(1))
    max_answer_length: int = setting(30, at_least(1))
    text_column: str | None = None
    pair_column: str | None = None
    label_column: str = "label"
    labels: list[str] | None = None  # null: the training file's labels, sorted
    # classification: one score per row (the label column's numbers), mean squared error,
    # Pearson and Spearman (transformers' num_labels=1)
    regression: bool = False
    # token classification: the files' tag scheme (null: detected), and whether every
    # sub-token of a word is labelled (default: its first only)
    tag_scheme: str | None = setting(None, one_of(("IOB1", "IOB2", "BIOES")).or_null())
    label_all_subtokens: bool = False
    # embedding: the pairs file's columns (sentence-transformers' names; a scored pair's texts
    # default to sentence1 and sentence2 where the file has no anchor and positive), the loss
    # (null: cosent for a file with a score column, else mnrl), the similarity scale, whether
    # positives are also ranked against anchors, and the dimensions trained on (Matryoshka)
    anchor_column: str = "anchor"
    positive_column: str = "positive"
    negative_column: str = "negative"
    score_column: str = "score"
    loss: str | None = setting(None, one_of(EMBEDDING_LOSSES).or_null())
    scale: float = setting(20.0, above(0))
    symmetric: bool = False
    matryoshka_dims: list[int] | None = None
    # null: the checkpoint's pooling (mean where it has none) and normalisation
    pooling: str | None = setting(None, one_of(POOLINGS).or_null())
    normalize: bool | None = None
    eval_batch_size: int = setting(64, at_least(1))
    # hidden and attention dropout; null: the checkpoint's
    dropout: float | None = setting(None, within("[0, 1)").or_null())
    # Batches of rows of similar length (pools of 50 batches sorted, as transformers'
    # group_by_length): with execution.trim_padding, short batches cost less.
    group_by_length: bool = False
    # Which of the learning rate and epochs (lr, epochs) popbert chose for the checkpoint's size:
    # `popbert finetune` and `popbert.finetune_config` choose those the user did not name and
    # list them here (the run says so when it starts). [] in a config made by hand:
    # optimizer.lr and finetune.epochs are then taken as they are.
    chosen_by_size: list[str] = setting(
        factory=list, rule=Rule(lambda v: set(v) <= {"lr", "epochs"}, "a list of lr, epochs"))

    def validate(self) -> None:
        check_fields(self, "finetune")

    def check_inputs(self) -> None:
        """A fine-tuning run names its checkpoint and training file. Checked when the run
        starts, not on load: the finetune-* presets name a task but no inputs."""
        for key in ("checkpoint", "train_file"):
            if self.task is not None and not getattr(self, key):
                raise Invalid(f"finetune.{key} must be set for finetune.task {self.task!r}",
                              f"finetune.{key}", "finetune.task")


SECTIONS: dict[str, type] = {
    "model": BertConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "execution": ExecutionConfig,
    "training": TrainingConfig,
    "tracking": TrackingConfig,
    "finetune": FinetuneConfig,
    "serve": ServeConfig,
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
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch x replicas x gradient accumulation."""
        e = self.execution
        return e.micro_batch_size * e.replicas * e.gradient_accumulation

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready) that `config_from_dict` turns back into an equal
        config: `preset`, then one mapping per section (`finetune` only for a fine-tuning
        run, `serve` only when set: a pre-training config reads as it always did). Credentials in
        `data.storage_options` are left out: everything a run writes comes from here, and a
        resumed run takes them from the environment again."""
        out = {"preset": self.preset,
               **{name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS
                  if (name != "finetune" or self.finetune.task is not None)
                  and (name != "serve" or self.serve != ServeConfig())}}
        out["data"]["storage_options"] = without_secrets(out["data"]["storage_options"])
        return out

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


class Origins:
    """Where each key's value came from: the --set override that gave it (or a mapping above
    it), else the file."""

    def __init__(self, source: str, key_sources: dict[str, str]) -> None:
        self.source = source
        self.key_sources = key_sources

    def __call__(self, key: str) -> str:
        key = re.sub(r"\[\d+\]", "", key)  # optimizer.betas[1] came with optimizer.betas
        while key:
            if key in self.key_sources:
                return self.key_sources[key]
            key = key.rpartition(".")[0]
        return self.source

    def blame(self, keys: tuple[str, ...]) -> str:
        """The origin of the first of `keys` that an override gave, else the file."""
        return next((self(k) for k in keys if self(k) != self.source), self.source)


def _check_across(cfg: RunConfig) -> None:
    """The rules that span sections (each section checks its own keys)."""
    m, d, e, t = cfg.model, cfg.data, cfg.execution, cfg.training
    if cfg.optimizer.name == "stableadamw" and e.replicated_tensor_sharding:
        raise Invalid("optimizer.name 'stableadamw' clips each tensor's update by its RMS over "
                      "the whole tensor, which a replica's shard does not hold; use adamw or "
                      "lamb with execution.replicated_tensor_sharding",
                      "optimizer.name", "execution.replicated_tensor_sharding")
    if e.pipeline and m.layers_per_ipu is None:
        raise Invalid("execution.pipeline needs model.layers_per_ipu (the layers of each "
                      "pipeline stage)", "execution.pipeline", "model.layers_per_ipu")
    if e.backend == "popart" and m.dialect != "popart":
        raise Invalid(f"execution.backend 'popart' needs model.dialect 'popart' (PopART reads "
                      f"ai.onnx opset 11), got {m.dialect!r}", "execution.backend",
                      "model.dialect")
    if t.eval_every and not d.has_validation:
        raise Invalid(f"training.eval_every is {t.eval_every} but there is no validation data: "
                      "set data.validation_files or data.validation_fraction (e.g. 0.02)",
                      "training.eval_every", "data.validation_files", "data.validation_fraction")
    if t.eval_points and t.time_budget is None:
        raise Invalid("training.eval_points spaces evaluations over training.time_budget; set "
                      "a budget, or use training.eval_every (steps)", "training.eval_points",
                      "training.time_budget")
    if t.eval_share is not None and t.time_budget is None:
        raise Invalid("training.eval_share sizes evaluations to training.time_budget; set a "
                      "budget, or remove training.eval_share", "training.eval_share",
                      "training.time_budget")
    if t.eval_share is not None and not ((t.eval_points or t.eval_every) and d.has_validation):
        raise Invalid("training.eval_share sizes the evaluations of training.eval_points or "
                      "training.eval_every on validation data (data.validation_files or "
                      "data.validation_fraction); this run has none to size: remove it",
                      "training.eval_share", "training.eval_points", "training.eval_every",
                      "data.validation_files", "data.validation_fraction")
    if e.trim_padding and (m.packed or m.dialect != "onnx"):
        raise Invalid("execution.trim_padding cuts unpadded rows to their longest; it needs "
                      "model.dialect 'onnx' and model.packed false (packed rows carry no "
                      "padding to cut)", "execution.trim_padding", "model.dialect",
                      "model.packed")
    if e.gradient_cache_rows is not None and (e.pipeline or cfg.finetune.task != "embedding"):
        raise Invalid("execution.gradient_cache_rows caches the gradients of an embedding "
                      "model's vectors: it needs finetune.task 'embedding' and "
                      "execution.pipeline false", "execution.gradient_cache_rows",
                      "finetune.task", "execution.pipeline")
    if e.trim_padding and cfg.finetune.task == "squad":
        raise Invalid("execution.trim_padding would change the loss of finetune.task 'squad': "
                      "its start/end softmax runs over every position, padding included (as in "
                      "BERT and transformers); set execution.trim_padding=false",
                      "execution.trim_padding", "finetune.task")
    if d.dynamic_masking and m.packed:
        raise Invalid("data.dynamic_masking masks unpacked rows; packed rows keep the masks "
                      "they were packed with (set data.dynamic_masking=false)",
                      "data.dynamic_masking", "model.packed")
    if t.batch_warmup:
        _check_batch_warmup(e)
    if t.sequence_curriculum:
        _check_curriculum(cfg)
    if t.global_batch_size is not None:
        per_pass = e.micro_batch_size * e.replicas
        layout = (f"execution.micro_batch_size ({e.micro_batch_size}) x execution.replicas "
                  f"({e.replicas})")
        keys = ("training.global_batch_size", "execution.micro_batch_size", "execution.replicas",
                "execution.gradient_accumulation")
        if t.global_batch_size % per_pass:
            raise Invalid(f"training.global_batch_size ({t.global_batch_size}) is not divisible "
                          f"by {layout} = {per_pass}", *keys[:3])
        if t.global_batch_size != cfg.global_batch_size:
            raise Invalid(f"training.global_batch_size ({t.global_batch_size}) != {layout} x "
                          f"execution.gradient_accumulation ({e.gradient_accumulation}) = "
                          f"{cfg.global_batch_size}; set execution.gradient_accumulation="
                          f"{t.global_batch_size // per_pass} or training.global_batch_size=null",
                          *keys)


def _check_curriculum(cfg: RunConfig) -> None:
    """What the sequence-length curriculum needs: rows of contiguous text it can cut anywhere
    and mask anew (MLM only, dynamic masking), unpacked rows in the onnx dialect (a symbolic
    sequence axis), and stages shorter than the model's rows."""
    m, d, t, key = cfg.model, cfg.data, cfg.training, "training.sequence_curriculum"
    longest = int(max(length for _, length in t.sequence_curriculum))
    if longest >= m.sequence_length:
        raise Invalid(f"{key} stage length {longest} must be below model.sequence_length "
                      f"({m.sequence_length}), which the run ends with", key,
                      "model.sequence_length")
    if m.next_sentence_prediction or not d.dynamic_masking:
        raise Invalid(f"{key} cuts rows of contiguous text and masks the pieces anew: it needs "
                      "model.next_sentence_prediction false and data.dynamic_masking true", key,
                      "model.next_sentence_prediction", "data.dynamic_masking")
    if m.packed or m.dialect != "onnx":
        raise Invalid(f"{key} needs model.dialect 'onnx' and model.packed false (rows whose "
                      "length can change)", key, "model.dialect", "model.packed")
    if t.batch_warmup:
        raise Invalid(f"{key} and training.batch_warmup cannot be combined; set one to off",
                      key, "training.batch_warmup")


def _check_batch_warmup(e: ExecutionConfig) -> None:
    """What batch-size warmup cannot do: it ramps the micro-batches of one step, so there must
    be several (gradient accumulation), each step must be its own run (device_iterations 1), and
    the step must not be compiled or scheduled for a fixed count (PopART, a pipeline)."""
    key = "training.batch_warmup"
    if e.gradient_accumulation == 1:
        raise Invalid(f"{key} ramps the micro-batches per step from 1 to "
                      "execution.gradient_accumulation, which is 1: nothing to ramp; raise "
                      "execution.gradient_accumulation (a smaller execution.micro_batch_size "
                      "keeps the global batch)", key, "execution.gradient_accumulation")
    if e.backend == "popart":
        raise Invalid(f"{key} needs execution.backend 'torch': PopART compiles each step for "
                      "execution.gradient_accumulation micro-batches", key, "execution.backend")
    if e.pipeline:
        raise Invalid(f"{key} is not supported with execution.pipeline (its schedule runs "
                      "execution.gradient_accumulation micro-batches per step); set "
                      f"{key}=0 or execution.pipeline=false", key, "execution.pipeline")
    if e.device_iterations > 1:
        raise Invalid(f"{key} changes the micro-batches from step to step, but "
                      f"execution.device_iterations ({e.device_iterations}) runs several steps "
                      "on one batch; set execution.device_iterations=1", key,
                      "execution.device_iterations")


def validate_run_config(cfg: RunConfig, source: str = "<config>",
                        key_sources: dict[str, str] | None = None) -> None:
    """Check every section and the rules between them.

    Raises a one-line ConfigError that starts with where the offending value came from:
    `key_sources` maps a dotted key to its origin (e.g. "--set optimizer.lr=0"), anything else
    is blamed on `source`.
    """
    origin = Origins(source, key_sources or {})
    for name in SECTIONS:
        bad = non_finite(getattr(cfg, name), name)
        if bad is not None:
            raise ConfigError(f"{origin(bad[0])}: {bad[0]} must be a finite number, got {bad[1]}")
    try:
        for name in SECTIONS:
            getattr(cfg, name).validate()
        _check_across(cfg)
    except Invalid as error:
        raise ConfigError(f"{origin.blame(error.keys)}: {error}") from None


def warn_config(cfg: RunConfig) -> None:
    """Log the settings that are valid but probably not meant (a warmup longer than the run).

    Not part of validation: every config read is validated, a checkpoint's stored one too
    (export, fine-tuning, sweeps read it), and its warnings are about a run that is over. Only
    what runs a config (a job) or shows it (`popbert config`) calls this.
    """
    o, e, t = cfg.optimizer, cfg.execution, cfg.training
    if o.lr_schedule is None and o.warmup_steps > t.steps:
        logger.warning("optimizer.warmup_steps (%d) exceeds training.steps (%d): the run ends "
                       "before reaching the peak learning rate", o.warmup_steps, t.steps)
    if e.stochastic_rounding and e.weight_dtype == "float32":
        logger.warning("execution.stochastic_rounding has no effect with float32 weights")


__all__ = ["BACKENDS", "DECAYS", "DEVICE", "DEVICES", "FINETUNE_TASKS",
           "LOSS_SCALINGS", "OPTIMIZERS", "PIPELINE_SCHEDULES", "SECTIONS", "TOP_LEVEL_KEYS",
           "TRACKERS", "BertConfig", "DataConfig", "ExecutionConfig", "FinetuneConfig",
           "OptimizerConfig", "RunConfig", "TrackingConfig", "TrainingConfig", "choice",
           "non_finite", "parse_lr_schedule", "validate_run_config", "warn_config"]

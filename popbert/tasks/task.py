"""What a fine-tuning task is: the entry each task module (`popbert.tasks.squad`,
`popbert.tasks.classification`) fills in, and what its data gives the job."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from popbert.builders.bert_config import TaskConfig


@dataclass(frozen=True)
class Flag:
    """One of a task's own `popbert finetune` flags: the config key it sets, argparse's
    keywords (type, metavar, help), and for a file the data format it must be (`Task.files`)."""

    name: str  # "--doc-stride"
    key: str  # "finetune.doc_stride"
    options: Mapping[str, Any] = field(default_factory=dict)
    file: str | None = None  # a data format ("squad", "rows") when the flag names a file
    list_of_text: bool = False  # "a,b,c" on the command line → a list

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


# What a task's score gets from the job: the graph's outputs for rows of input arrays (the
# trained weights, no dropout, in batches).
Infer = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Setting:
    """What a task's data is read with: the checkpoint's tokenizer and the run's config."""

    vocab: Path  # the checkpoint's vocab.txt or tokenizer.json
    lowercase: bool
    max_seq_length: int
    family: str  # the checkpoint's model.architecture
    hf_architecture: str | None  # the task's transformers class for that family
    hidden_size: int = 0  # the checkpoint's width
    checkpoint_task: TaskConfig | None = None  # the checkpoint's own model.task (its pooling)


class TaskData(Protocol):
    """A task's data for one run, read before training (`Task.read`)."""

    arrays: dict[str, np.ndarray]  # the training features, named as the graph's inputs

    def task_config(self) -> TaskConfig:
        """The head's settings recorded in the checkpoint's `model.task` (what export needs)."""

    def score(self, infer: Infer, output_dir: Path) -> dict[str, float]:
        """Score the trained weights on the evaluation file; write what the task writes
        (predictions, eval_results.json) into `output_dir`; {} when there is nothing to score."""


@dataclass(frozen=True)
class Task:
    """One fine-tuning task: what the jobs, exports and commands read."""

    name: str  # finetune.task and model.task.name
    command: str  # `popbert finetune <command>`; a sweep's `job: finetune <command>`
    help: str  # the subcommand's one-line help
    description: str  # and its description
    files: str  # the format of --train (and of export's --eval/--calibration): "squad", "rows"
    read: Callable[[Any, Setting], TaskData]  # (RunConfig, Setting) → the run's data
    flags: tuple[Flag, ...]  # its own flags, besides every task's (`popbert.train.finetune`)
    default_max_seq_length: int
    metric_keys: tuple[str, ...]  # what the loop logs of the graph's outputs
    final_metrics: tuple[str, ...]  # what `score` returns (and eval_results.json holds)
    # The learning rate and epochs at hidden <= 256 and at BERT-Base's 768 and wider
    # (`popbert.train.finetune.finetune_defaults` interpolates between them).
    size_defaults: tuple[tuple[float, int], tuple[float, int]]
    hf_architectures: Mapping[str, str]  # family → its transformers class for the task
    outputs: tuple[str, ...]  # the inference graph's outputs
    metadata_keys: tuple[str, ...]  # model.task fields an export stores for serving
    head_keys: tuple[str, ...] = ()  # model.* keys that set the new head (they take effect)
    aliases: tuple[str, ...] = ()  # other names of its `popbert finetune` subcommand
    always_print_metrics: bool = False  # print the JSON line even when nothing was scored
    # "module:Class" of the torch-free predictor that runs its exports (`popbert serve`, and the
    # rows `export --calibration` reads, in `popbert.serve`); named, not imported, so a task
    # never depends on serving.
    predictor: str | None = None
    # The inference outputs with a value per position ([N, S, ...]) and what a masked position
    # of them holds when rows run cut to their batch's longest (`popbert.runtime.buckets`):
    # a value no decoding picks.
    per_token_outputs: Mapping[str, float] = field(default_factory=dict)
    # Inference outputs a run fetches only when its caller names them: large per-token states
    # that most requests do not read ([N, S, H] where the task's answer is [N, H]).
    on_request_outputs: tuple[str, ...] = ()

    @property
    def preset(self) -> str:
        return f"finetune-{self.name}"

    def hf_architecture(self, family: str) -> str | None:
        return self.hf_architectures.get(family)


__all__ = ["Flag", "Infer", "Setting", "Task", "TaskData"]

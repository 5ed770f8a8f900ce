"""The fine-tuning tasks: one table, one module each, as `popbert.builders.families` is for the
model families.

A task owns everything that differs between fine-tuning jobs: its head in the graph (and its
loss), how it reads its training and evaluation files, how it scores the trained weights, its
own flags and the config keys they set, the learning rate and epochs a checkpoint's size gets,
the graph outputs and metadata its export carries, its `popbert finetune` subcommand (and so
the sweep job `finetune <command>`) and its `transformers` class per family. Everything else —
the checkpoint it starts from, the epochs-to-steps and warm-up derivation, the loop, the
exports' checks — is shared and reads this table: `popbert.train.finetune`,
`popbert.export.inference`, `popbert.io.paths`, `popbert.hf.mapping`, `popbert.cli` and
`popbert.sweep`. Adding a task is one module and one line in `TASKS`.

A task module depends only on the graph builder, the data readers and the config: the jobs,
exports and commands above it pass in what they own (the inference over the trained weights).
"""

from __future__ import annotations

from typing import Any

from popbert.builders.bert_config import TASK_NAMES, BertConfig
from popbert.tasks import classification, embedding, squad, token_classification
from popbert.tasks.task import Flag, Infer, Setting, Task, TaskData

# Importing a task module registers its head with the builder (`register_task`).
TASKS: dict[str, Task] = {task.name: task for task in (squad.TASK, classification.TASK,
                                                        token_classification.TASK,
                                                        embedding.TASK)}
assert tuple(TASKS) == TASK_NAMES, "popbert.builders.bert_config.TASK_NAMES lists the tasks"


def task_named(name: str) -> Task:
    """The task `finetune.task` or `model.task.name` names."""
    return TASKS[name]


def task_of_command(command: str) -> Task:
    """The task of `popbert finetune <command>` (a sweep's `finetune <command>`)."""
    return next(task for task in TASKS.values()
                if command == task.command or command in task.aliases)


def task_metadata(config: BertConfig, task_name: str | None = None) -> dict[str, Any]:
    """The `model.task` fields an export of `config` for `task_name` (default: the task the
    checkpoint was fine-tuned for; an imported one names none) stores for serving, besides its
    lowercasing and vocabulary, which every task's export stores."""
    task = TASKS.get(task_name or config.task.name or "")
    keys = task.metadata_keys if task is not None else ()
    return {key: getattr(config.task, key) for key in keys
            if getattr(config.task, key) is not None}


__all__ = ["TASKS", "Flag", "Infer", "Setting", "Task", "TaskData", "task_metadata",
           "task_named", "task_of_command"]

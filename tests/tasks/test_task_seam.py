"""The task seam: each fine-tuning task is one module of `popbert.tasks` and one entry in its
table, which the builder, the job, the exports, the path checks, the Hugging Face mapping, the
command line and the sweeps read; moving classification and SQuAD onto it changed no graph.

The hashes are SHA-256 of each task graph's deterministic serialization (with its loss, and the
inference graph without), for every family, recorded from dca6ae7, the last commit before the
seam, and checked equal after it. A change that alters any of these graphs fails here; if it is
meant, record the new hashes and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from pathlib import Path

import numpy as np
import pytest
from bert_helpers import small_config

import popbert.tasks
from popbert.builders.bert import TASK_HEADS, build_bert
from popbert.builders.bert_config import TASK_NAMES, TaskConfig
from popbert.cli.main import build_parser
from popbert.config import FinetuneConfig, list_presets, load_config
from popbert.config.sections import ExecutionConfig
from popbert.export.inference import TASKS as EXPORT_TASKS
from popbert.hf import mapping as hf_mapping
from popbert.io import paths
from popbert.sweep.spec import JOBS, finetune_args
from popbert.tasks import TASKS

FAMILY = {"bert": {}, "groupbert": {"architecture": "groupbert"},
          "modernbert": {"architecture": "modernbert", "next_sentence_prediction": False}}
CONFIGS = {"squad": TaskConfig(name="squad"),
           "classification": TaskConfig(name="classification", num_labels=3),
           "token-classification": TaskConfig(name="token-classification", num_labels=3,
                                              labels=["O", "B-X", "I-X"]),
           "embedding": TaskConfig(name="embedding", pooling="mean")}
BEFORE_THE_SEAM = {
    "bert-squad": "55756700c0c754c8eaa28f65a07f86e443f26525dc9db36137bfe0fc6a68847b",
    "bert-squad-inference": "bc593abf30deb19c84fe4fc3eb8a6341e4fd91a6a3fe3429513df5e59881a81c",
    "bert-classification": "6efbb3bfd83532b2a75661f73cc12817abce4db3be892c1de4b764d767788ffd",
    "bert-classification-inference":
        "17d1e10f3502778783737ed82d40d53d65b40507d685ce06fed475519cb848ce",
    "groupbert-squad": "51c5a2f4de72d993236bed89c4eced15312ac7ae0426910a17dcde142962d14f",
    "groupbert-squad-inference": "3bf0495590eee7fdf182d227a2877ab6e6f6ee441d005657d81d7277c91b3141",
    "groupbert-classification": "7d3df22652188b72bec943108b8a8670da2775bfb243a37ae46b3794ce81678a",
    "groupbert-classification-inference":
        "61272b823b20c075417295a77575706d1d8b9672567c858b6f1d7d47ab6fc1de",
    "modernbert-squad": "b6a46e14f1101bfc796fdd0ba78c77edb0a7538495f6f8b7b9fc5592e327d7d6",
    "modernbert-squad-inference":
        "ac05b29b5ac840f5ff0a7b6d5fb6949c38b45ef9a87b863824f2ed30d570e142",
    "modernbert-classification": "ffc8c1be8df3e3113bad714d46ba7fd03b77e2b8572cf3cda3e233f759f0afd5",
    "modernbert-classification-inference":
        "e770eb7638a48318ca8d5eaebaf6fec3167ddac8301548cfe2b1f205e5573b96",
}


@pytest.mark.parametrize("name", sorted(BEFORE_THE_SEAM))
def test_task_graphs_are_byte_identical_to_before_the_seam(name: str) -> None:
    family, rest = name.split("-", 1)
    task = rest.removesuffix("-inference")  # the hashes pin the tasks that were before
    # every row of the last layer, as before; without `all_rows` a classification head's last
    # layer computes [CLS] alone (tests/builders/test_first_row_layer.py: the same outputs)
    graph = build_bert(small_config(**FAMILY[family], task=CONFIGS[task]), task=task,
                       with_loss=not rest.endswith("-inference"), all_rows=True).model().graph
    digest = hashlib.sha256(graph.SerializeToString(deterministic=True)).hexdigest()
    assert digest == BEFORE_THE_SEAM[name]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_task_is_one_entry_that_every_layer_reads(name: str) -> None:
    task = TASKS[name]
    assert TASK_HEADS[name].__module__ == f"popbert.tasks.{name.replace('-', '_')}"  # its head
    assert task.preset in list_presets() and load_config(task.preset).finetune.task == name
    # the inference graph's outputs are the ones the export and serving read
    graph = build_bert(small_config(task=CONFIGS[name]), task=name, with_loss=False).model()
    assert tuple(o.name for o in graph.graph.output) == task.outputs
    # each flag sets a finetune key (or how the session runs: an execution key), and the
    # command has them all
    fields = {f"finetune.{f.name}" for f in dataclasses.fields(FinetuneConfig)} | {
        f"execution.{f.name}" for f in dataclasses.fields(ExecutionConfig)}
    assert all(flag.key in fields for flag in task.flags)
    command = dict(paths.subparsers(build_parser()))[("finetune", task.command)]
    options = {o for action in command._actions for o in action.option_strings}
    assert {flag.name for flag in task.flags} <= options
    assert command.get_default("finetune_task") == name
    # the sweep job, the export task, the data format, the transformers classes
    assert f"finetune {task.command}" in JOBS
    assert set(finetune_args(f"finetune {task.command}")) >= {f.dest for f in task.flags}
    assert name in EXPORT_TASKS and task.files in paths.TRAINING_FILES
    for family, architecture in task.hf_architectures.items():
        assert hf_mapping.ARCHITECTURES[architecture].family == family
        assert hf_mapping.task_architecture(family, name) == architecture
    assert hf_mapping.task_architecture("groupbert", name) is None
    assert typing.get_type_hints(type(task))  # a typed entry


def test_a_sweep_takes_each_flag_as_its_kind() -> None:
    assert finetune_args("finetune classify")["regression"] is bool
    assert finetune_args("finetune token-classification")["label_all_subtokens"] is bool
    assert finetune_args("finetune token-classification")["eval"] == "path"
    assert finetune_args("finetune squad")["doc_stride"] is int


def test_the_table_is_the_config_s_list_of_tasks() -> None:
    assert tuple(TASKS) == TASK_NAMES
    assert len({task.command for task in TASKS.values()}) == len(TASKS)
    assert popbert.tasks.task_of_command("classify") is TASKS["classification"]


FIXTURES = Path(__file__).parent.parent / "fixtures"
TRIMMED = {  # task command, its extra flags, its training file
    "classification": ("classify", [], FIXTURES / "classification" / "sentiment.tsv"),
    "regression": ("classify", ["--regression"],
                   FIXTURES / "classification" / "relatedness.tsv"),
    "token-classification": ("ner", [], FIXTURES / "ner" / "sample.conll"),
}



@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(TRIMMED))
def test_rows_cut_to_their_longest_give_the_padded_loss(case: str, pretrained: Path,
                                                        tmp_path: Path) -> None:
    """No padding computed (execution.trim_padding): each task's losses over two epochs equal
    the padded run's to 1e-5 (dropout off, one thread: the same arithmetic but for the
    padding's share)."""
    import json

    from popbert.cli.main import main

    command, extra, data = TRIMMED[case]
    losses = {}
    for trimmed in (True, False):
        run = tmp_path / f"trim-{trimmed}"
        assert main(["finetune", command, "--checkpoint", str(pretrained), "--train",
                     str(data), *extra, "--epochs", "2", "--batch-size", "2", "--dropout", "0",
                     "--max-seq-length", "48", "--log-every", "1", "--threads", "1",
                     "--device", "cpu", "--set", f"execution.trim_padding={str(trimmed).lower()}",
                     "-o", str(run)]) == 0
        losses[trimmed] = [json.loads(line)["loss"]
                           for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) >= 4
    np.testing.assert_allclose(losses[True], losses[False], atol=1e-5, rtol=0)


def test_every_task_names_the_predictor_that_serves_it() -> None:
    """`popbert serve` finds each task's predictor through the table: a class of
    `popbert.serve` that loads that task's exports."""
    import inspect

    from popbert.serve.predict import ExportedModel, predictor_class
    from popbert.tasks import TASKS

    for name in TASKS:
        predictor = predictor_class(name)
        assert predictor is not None and issubclass(predictor, ExportedModel), name
        assert predictor.__module__.startswith("popbert.serve."), name
        assert "spinning" in inspect.signature(predictor).parameters, name

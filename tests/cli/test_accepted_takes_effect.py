"""Nothing is accepted that does nothing: `--init-from` that carries over almost nothing, a
`--set` key fine-tuning would override with the checkpoint's, a family's own settings on
another family, `--calibration` the export would not read. Each is one line and exit 2 through
the real CLI, before any work; what can take effect does."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest
import torch

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.config import dump_config, load_config
from popbert.graph.annotations import trainable_initializers
from popbert.io.checkpoint import Checkpoint, save_checkpoint

FIXTURES = Path(__file__).parent.parent / "fixtures"
SENTIMENT = FIXTURES / "classification" / "sentiment.tsv"
SQUAD = FIXTURES / "squad" / "squad-v1.1-sample.json"
# Small shapes of each family, on the bundled corpus and vocabulary, a few steps.
SMALL = ["model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=48",
         "model.num_layers=2", "model.sequence_length=32", "model.max_position_embeddings=64",
         "model.max_predictions_per_seq=5", "execution.micro_batch_size=4",
         "execution.device=cpu", "training.steps=1", "training.log_every=1",
         "training.time_budget=null", "training.eval_points=0", "optimizer.warmup_steps=0"]
PRESETS = {"bert": "tiny", "modernbert": "fast", "groupbert": "groupbert-fast"}
FAMILY_KEYS = {"bert": [], "groupbert": ["model.groupbert.ffn_groups=2",
                                         "model.groupbert.conv_group_size=8"],
               "modernbert": ["model.modernbert.local_attention=16"]}


def overrides(family: str) -> list[str]:
    return [*SMALL, *FAMILY_KEYS[family]]


def set_args(keys: list[str]) -> list[str]:
    return [a for key in keys for a in ("--set", key)]


def save_random(directory: Path, family: str, task: str = "pretraining",
                extra: tuple[str, ...] = ()) -> Path:
    """A pre-training run's checkpoint of `family` at small shapes, random weights (as a run
    saves one; nothing trained)."""
    cfg = load_config(PRESETS[family], [*overrides(family), *extra])
    model = build_bert(cfg.model, task=task, seed=0).model()
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = {n: torch.from_numpy(values[n].copy()) for n in trainable_initializers(model)}
    save_checkpoint(directory / "checkpoints" / "step-000001",
                    Checkpoint(step=1, weights=weights), dump_config(cfg))
    return directory


def one_line(capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    """The one error line (the last thing on stderr; the run's own log lines may precede it)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("popbert: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == errors[0], err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture(autouse=True)
def quiet_cli(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)


# ------------------------------------------------------------------------ --init-from across


@pytest.mark.parametrize(("ours", "theirs"), [("bert", "modernbert"), ("modernbert", "bert"),
                                              ("groupbert", "bert")])
def test_init_from_another_family_is_refused(ours: str, theirs: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    checkpoint = save_random(tmp_path / "theirs", theirs)
    run = tmp_path / "run"
    assert main(["pretrain", "--config", PRESETS[ours], *set_args(overrides(ours)),
                 "--init-from", str(checkpoint), "--output-dir", str(run)]) == 2
    line = one_line(capsys, "--init-from", f"model.architecture {theirs}",
                    f"model.architecture {ours}", "training.allow_partial_init_from=true")
    assert "encoder weights" in line
    assert not run.exists()  # nothing half-written


def test_init_from_another_family_when_asked_for(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from popbert.cli.main import main

    checkpoint = save_random(tmp_path / "theirs", "modernbert")
    run = tmp_path / "run"
    assert main(["pretrain", "--config", "tiny", *set_args(overrides("bert")),
                 "--set", "training.allow_partial_init_from=true",
                 "--init-from", str(checkpoint), "--output-dir", str(run)]) == 0
    assert "training.allow_partial_init_from" in caplog.text
    assert load_config(run / "config.yaml").training.allow_partial_init_from


def test_init_from_the_same_family_carries_over(tmp_path: Path) -> None:
    """Phase 1 → 2 (a longer sequence): every encoder weight fits, nothing is refused."""
    from popbert.cli.main import main

    checkpoint = save_random(tmp_path / "phase1", "bert")
    assert main(["pretrain", "--config", "tiny", *set_args(overrides("bert")),
                 "--set", "model.sequence_length=64", "--init-from", str(checkpoint),
                 "--output-dir", str(tmp_path / "phase2")]) == 0


# ------------------------------------------------------------------- export --calibration


@pytest.fixture(scope="module")
def bert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random(tmp_path_factory.mktemp("bert") / "run", "bert")


@pytest.fixture
def no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any export started is a failure: the refusals come before the work."""
    import popbert.export.inference as export

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export ran before its inputs were checked")

    monkeypatch.setattr(export, "export_weights", refuse)


TXT_ROWS = "a fine film\nnot good at all\n"
EXPORT_CASES = {
    # (task, extra flags, the data file's kind, fragments of the one line)
    "classification reads no SQuAD": ("classification", ["--quantize", "int8"], "squad",
                                      ["--calibration (a classification export)",
                                       "SQuAD JSON file"]),
    "squad reads no rows": ("squad", ["--quantize", "int8"], "rows",
                            ["--calibration (a squad export)", "SQuAD v1.1 JSON"]),
    "encoder reads no data": ("encoder", ["--quantize", "int8"], "rows",
                              ["the encoder export reads no task data"]),
    "without --quantize": ("classification", [], "rows", ["--calibration", "--quantize int8"]),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_calibration_is_read_as_its_task_reads_it(
        case: str, bert_checkpoint: Path, tmp_path: Path, no_export: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    task, extra, kind, fragments = EXPORT_CASES[case]
    data = SQUAD if kind == "squad" else SENTIMENT
    out = tmp_path / "ir"
    assert main(["export", "--checkpoint", str(bert_checkpoint), "--task", task, "--runtime",
                 "openvino", "--precision", "f32", *extra, "--calibration", str(data),
                 "--output", str(out)]) == 2
    one_line(capsys, *fragments)
    assert not out.exists()


@pytest.mark.parametrize(("task", "kind"), [("classification", "squad"), ("squad", "rows")])
def test_export_eval_is_read_as_its_task_reads_it(task: str, kind: str, bert_checkpoint: Path,
                                                  tmp_path: Path, no_export: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    out = tmp_path / "m.onnx"
    assert main(["export", "--checkpoint", str(bert_checkpoint), "--task", task, "--eval",
                 str(SQUAD if kind == "squad" else SENTIMENT), "--output", str(out)]) == 2
    one_line(capsys, f"--eval (a {task} export)")
    assert not out.exists()


# ------------------------------------------------- finetune --set, family sections everywhere


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return {family: save_random(root / family, family) for family in PRESETS}


def finetune(checkpoint: Path, out: Path, task: str = "classify", *extra: str) -> list[str]:
    data = ["--train", str(SENTIMENT)] if task == "classify" else ["--train", str(SQUAD)]
    return ["finetune", task, "--checkpoint", str(checkpoint), *data, "--max-seq-length", "32",
            "--epochs", "1", "--batch-size", "8", "--device", "cpu", "--output-dir", str(out),
            *extra]


def test_finetune_applies_the_new_heads_pooling(checkpoints: dict[str, Path],
                                                tmp_path: Path) -> None:
    from popbert.cli.main import main

    run = tmp_path / "run"
    assert main(finetune(checkpoints["modernbert"], run, "classify",
                         "--set", "model.modernbert.classifier_pooling=mean")) == 0
    model = load_config(run / "config.yaml").model
    assert model.architecture == "modernbert"
    assert model.modernbert.classifier_pooling == "mean"
    # and without the key, the checkpoint's own pooling
    assert main(finetune(checkpoints["modernbert"], tmp_path / "plain", "classify")) == 0
    plain = load_config(tmp_path / "plain" / "config.yaml").model
    assert plain.modernbert.classifier_pooling == "cls"


# Keys `popbert finetune` would override with the checkpoint's config or derive itself, for
# each checkpoint family and task: (family, task, --set, fragments of the one line).
REFUSED = [
    ("modernbert", "classify", "model.architecture=bert", ["fine-tuning takes model.*",
                                                           "a ModernBERT"]),
    ("bert", "classify", "model.architecture=modernbert", ["a BERT", "would do nothing"]),
    ("bert", "classify", "model.modernbert.classifier_pooling=mean",
     ["model.modernbert.classifier_pooling", "a BERT"]),
    ("groupbert", "classify", "model.modernbert.classifier_pooling=mean", ["a GroupBERT"]),
    ("modernbert", "squad", "model.modernbert.classifier_pooling=mean", ["a ModernBERT"]),
    ("bert", "classify", "model.num_layers=4", ["model.num_layers would do nothing"]),
    ("modernbert", "classify", "model.groupbert.ffn_groups=2", ["model.groupbert.ffn_groups"]),
    ("bert", "classify", "data.masked_lm_prob=0.3", ["fine-tuning takes data.*"]),
    ("bert", "squad", "training.steps=5", ["finetune.epochs"]),
    ("bert", "classify", "optimizer.warmup_steps=3", ["finetune.warmup_proportion"]),
    ("bert", "classify", "model.sequence_length=16", ["--max-seq-length"]),
    ("modernbert", "classify", "model.hidden_dropout=0.2", ["--dropout"]),
]


@pytest.mark.parametrize(("family", "task", "key", "fragments"), REFUSED,
                         ids=[f"{f}-{t}-{k.split('=')[0]}" for f, t, k, _ in REFUSED])
def test_finetune_refuses_what_would_do_nothing(family: str, task: str, key: str,
                                                fragments: list[str],
                                                checkpoints: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    run = tmp_path / "run"
    assert main(finetune(checkpoints[family], run, task, "--set", key)) == 2
    one_line(capsys, f"--set {key}", *fragments)
    assert not run.exists()


# A family's own section on another family, in every command that reads a config.
FAMILY_COMMANDS = {
    "pretrain": lambda key: ["pretrain", "--config", "tiny", "--set", key],
    "config": lambda key: ["config", "--config", "tiny", "--set", key],
    "plan": lambda key: ["plan", "--config", "tiny", "--set", key],
}


@pytest.mark.parametrize("command", sorted(FAMILY_COMMANDS))
@pytest.mark.parametrize("key", ["model.modernbert.classifier_pooling=mean",
                                 "model.groupbert.ffn_groups=2"])
def test_a_familys_section_on_another_family_is_refused(command: str, key: str,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from popbert.cli.main import main

    assert main(FAMILY_COMMANDS[command](key)) == 2
    one_line(capsys, f"--set {key}", "the model is 'bert'", "would do nothing")


def test_a_familys_section_in_a_file_on_another_family_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text("preset: fast\nmodel:\n  architecture: bert\n"
                      "  next_sentence_prediction: true\n")
    assert main(["config", "--config", str(config)]) == 2
    one_line(capsys, f"{config}: model.modernbert.", "the model is 'bert'")


# The same keys in a fine-tuning --config file: refused when they would change nothing the run
# uses; a file that repeats the run's values (a dumped config) and one of the keys fine-tuning
# reads pass.
FILE_REFUSED = [("model:\n  num_layers: 4\n", "model.num_layers: 4 would do nothing"),
                ("training:\n  steps: 7\n", "finetune.epochs"),
                ("preset: finetune-classification\ndata:\n  masked_lm_prob: 0.3\n",
                 "fine-tuning takes data.*")]


@pytest.mark.parametrize(("text", "fragment"), FILE_REFUSED,
                         ids=["model", "derived", "data-over-preset"])
def test_finetune_config_file_keys_that_would_do_nothing_are_refused(
        text: str, fragment: str, checkpoints: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    config = tmp_path / "finetune.yaml"
    config.write_text(text)
    run = tmp_path / "run"
    assert main(finetune(checkpoints["bert"], run, "classify", "--config", str(config))) == 2
    one_line(capsys, f"--config {config}: ", fragment)
    assert not run.exists()


def test_finetune_config_files_that_take_effect_pass(checkpoints: dict[str, Path],
                                                     tmp_path: Path) -> None:
    from popbert.cli.main import main
    from popbert.train.finetune import finetune_config

    dumped = tmp_path / "dumped.yaml"
    assert main(["config", "--config", "finetune-classification", "-o", str(dumped)]) == 0
    lr = tmp_path / "lr.yaml"
    lr.write_text("optimizer:\n  lr: 1.0e-4\n")
    for config in (dumped, lr):
        cfg = finetune_config("classification", checkpoints["bert"], SENTIMENT, config=config)
        assert cfg.finetune.task == "classification"
    assert finetune_config("classification", checkpoints["bert"], SENTIMENT,
                           config=lr).optimizer.lr == 1e-4

"""`popbert plot RUN_DIR...`: two real tiny runs overlaid in one PNG, each named by the config keys
that differ between them; bad paths and unknown metrics are one-line errors (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from popbert.cli.main import main
from popbert.observe.compare import (
    compare_runs,
    config_differences,
    default_metrics,
    draw_comparison,
    load_run,
    run_labels,
)
from popbert.observe.plots import metric_series
from popbert.observe.tracking import read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.intermediate_size=128",
        "model.sequence_length=64", "model.max_position_embeddings=64",
        "model.max_predictions_per_seq=10", "execution.micro_batch_size=8",
        "optimizer.warmup_steps=1", "training.steps=4", "training.log_every=1",
        "data.validation_fraction=0.02", "training.eval_batches=1", "training.eval_every=2"]


def pretrain(output: Path, *overrides: str) -> None:
    args = ["pretrain", "--output-dir", str(output)]
    for override in (*TINY, *overrides):
        args += ["--set", override]
    assert main(args) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two real runs: BERT at lr 1e-3 and GroupBERT at lr 3e-3 (the run names differ too, but
    tracking.* is not part of what a legend compares)."""
    root = tmp_path_factory.mktemp("compare")
    pretrain(root / "bert", "optimizer.lr=0.001", "tracking.run_name=first")
    pretrain(root / "groupbert", "optimizer.lr=0.003", "model.architecture=groupbert",
             "tracking.run_name=second")
    return root / "bert", root / "groupbert"


@pytest.mark.e2e
def test_legend_names_what_differs_and_curves_are_the_logged_values(
        runs: tuple[Path, Path]) -> None:
    loaded = [load_run(runs[0]), load_run(runs[1] / "metrics.jsonl")]  # a dir or its metrics
    labels = run_labels(loaded)
    assert labels == ["model.architecture=bert, optimizer.lr=0.001",
                      "model.architecture=groupbert, optimizer.lr=0.003"]
    metrics = default_metrics(loaded)
    assert metrics[0] == "loss" and "val_mlm_loss" in metrics
    assert all(m == "loss" or m.startswith("val_") for m in metrics)
    fig = draw_comparison(loaded, labels, metrics)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == metrics
    legend_texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_texts == labels
    loss_ax, val_ax = axes[0], axes[metrics.index("val_mlm_loss")]
    for run_dir, loss_line, val_line in zip(runs, loss_ax.get_lines(), val_ax.get_lines(),
                                            strict=True):
        records = read_metrics(run_dir / "metrics.jsonl")
        assert list(loss_line.get_xdata()) == [r["step"] for r in records] == [1, 2, 3, 4]
        assert list(loss_line.get_ydata()) == [r["loss"] for r in records]
        assert list(val_line.get_xdata()) == [2, 4]
        assert list(val_line.get_ydata()) == [r["val_mlm_loss"] for r in records
                                              if "val_mlm_loss" in r]
    # The same run in both lines' colour on every subplot.
    assert [ln.get_color() for ln in loss_ax.get_lines()] == \
        [ln.get_color() for ln in val_ax.get_lines()]


@pytest.mark.e2e
def test_cli_writes_one_png(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "plots" / "compare.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    chosen = tmp_path / "val.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "--metric", "val_mlm_loss",
                 "--metric", "mlm_accuracy", "-o", str(chosen)]) == 0
    assert chosen.read_bytes().startswith(PNG_MAGIC)
    # One run directory alone: its own full plot (as for its metrics.jsonl).
    single = tmp_path / "single.png"
    assert main(["plot", str(runs[0]), "-o", str(single)]) == 0
    assert single.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.e2e
def test_equal_configs_are_told_apart_by_directory(runs: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    same = [load_run(runs[0]), load_run(runs[0])]
    same[1].run_dir = tmp_path / "copy"
    assert run_labels(same) == [runs[0].name, "copy"]
    # Only the metric asked for is drawn, in its own subplot.
    fig = draw_comparison(same, run_labels(same), ["val_loss"])
    (ax,) = [a for a in fig.axes if a.get_visible()]
    assert ax.get_title() == "val_loss"
    assert list(ax.get_lines()[0].get_ydata()) == \
        metric_series(same[0].records, "val_loss")[1]


def test_config_differences() -> None:
    configs = [{"model": {"hidden_size": 64, "architecture": "bert"},
                "optimizer": {"lr": 0.001, "betas": [0.9, 0.999]},
                "tracking": {"run_name": "a"}},
               {"model": {"hidden_size": 64, "architecture": "bert"},
                "optimizer": {"lr": 1e-05, "betas": [0.9, 0.98], "clip": None},
                "tracking": {"run_name": "b"}}]
    assert config_differences(configs) == [
        {"optimizer.lr": "0.001", "optimizer.betas": "[0.9,0.999]", "optimizer.clip": "(unset)"},
        {"optimizer.lr": "1e-05", "optimizer.betas": "[0.9,0.98]", "optimizer.clip": "null"},
    ]
    assert config_differences([configs[0], configs[0]]) == [{}, {}]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("popbert: error: "), err
    return err[0]


@pytest.mark.e2e
def test_bad_input_is_one_line(runs: tuple[Path, Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out.png")
    missing = tmp_path / "missing"
    assert "missing: not found" in _one_line_error(
        capsys, ["plot", str(runs[0]), str(missing), "-o", out])
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert "notes.txt: not metrics JSON lines" in _one_line_error(
        capsys, ["plot", str(runs[0]), str(a_file), "-o", out])
    empty = tmp_path / "empty-run"
    empty.mkdir()
    line = _one_line_error(capsys, ["plot", str(empty), str(runs[1]), "-o", out])
    assert str(empty) in line and "without metrics.jsonl" in line
    line = _one_line_error(capsys, ["plot", str(runs[0]), str(runs[1]), "--metric",
                                    "val_bleu", "-o", out])
    assert "--metric val_bleu: no run logged it" in line and "val_mlm_loss" in line
    assert not Path(out).exists()
    with pytest.raises(Exception, match="no run logged it"):
        compare_runs([runs[0]], out, metrics=["nope"])

"""metrics.jsonl logging, the optional W&B mirror, and the metrics plot."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from popbert.errors import ConfigError, UsageError
from popbert.observe.plots import plot_metrics
from popbert.observe.tracking import MetricsLogger, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_record(step: int, total: int = 50) -> dict[str, float]:
    frac = step / total
    return {
        "loss": 9.0 - 4 * frac,
        "mlm_loss": 8.3 - 4 * frac,
        "nsp_loss": 0.7 - 0.1 * frac,
        "mlm_accuracy": 0.05 + 0.3 * frac,
        "nsp_accuracy": 0.5 + 0.2 * frac,
        "lr": 1e-3 * min(1.0, step / 5),
        "seq_per_s": 120.0 + step,
    }


def test_logger_appends_flushed_json_lines(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path / "run", {"model": {"hidden_size": 8}})
    logger.log({"loss": np.float32(2.5), "lr": np.array(1e-3)}, step=1)
    # Flushed per line: readable while the logger is still open.
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "loss": 2.5, "lr": pytest.approx(1e-3)}
    ]
    logger.log({"step": 2, "loss": float("nan"), "counts": np.array([1, 2])})
    logger.close()
    logger.close()  # idempotent
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    second = json.loads(lines[1])
    assert second["step"] == 2 and math.isnan(second["loss"]) and second["counts"] == [1, 2]
    with pytest.raises(ValueError):
        logger.log({"loss": 1.0}, step=3)


def test_logger_requires_step_and_appends_on_resume(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, {}) as logger, pytest.raises(ValueError, match="step"):
        logger.log({"loss": 1.0})
    with MetricsLogger(tmp_path, {}) as logger:
        logger.log({"loss": 1.0}, step=1)
    with MetricsLogger(tmp_path, {}) as logger:
        logger.log({"loss": 0.5}, step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_read_metrics_skips_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 3.0}]


def test_a_resumed_log_drops_a_torn_last_line(tmp_path: Path) -> None:
    """A torn last line (a full disk, a power cut) goes when a resumed run opens the file, so
    its first record starts a line of its own instead of joining the fragment."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with MetricsLogger(tmp_path, {}, resume_step=1) as logger:
        logger.log({"loss": 1.5}, step=2)
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def test_a_full_disk_leaves_no_torn_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from popbert.errors import WriteError

    logger = MetricsLogger(tmp_path, {})
    logger.log({"loss": 2.0}, step=1)
    file = logger._file
    assert file is not None

    class Full:  # half the line reaches the disk, then ENOSPC
        def write(self, text: str) -> int:
            file.write(text[: len(text) // 2])
            file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name: str) -> Any:
            return getattr(file, name)

    logger._file = Full()  # type: ignore[assignment]
    with pytest.raises(WriteError, match="metrics.jsonl: cannot write: No space left"):
        logger.log({"loss": 1.5}, step=2)
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_wandb_missing_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsLogger(tmp_path, {}, backend="wandb")
    with pytest.raises(ConfigError, match="tracking.backend"):
        MetricsLogger(tmp_path, {}, backend="tensorboard")


class FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.id = kwargs.get("id") or "run123"
        self.logged: list[tuple[dict[str, Any], int]] = []
        self.summary: dict[str, Any] = {}
        self.finished = False

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[FakeRun] = []

    def init(**kwargs: Any) -> FakeRun:
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = {"optimizer": {"lr": 0.1}}
    logger = MetricsLogger(tmp_path, config, backend="wandb", project="proj", run_name="r1")
    logger.log({"loss": 2.0, "nsp_loss": float("nan")}, step=10)
    logger.close()
    run = runs[0]
    assert run.kwargs["project"] == "proj" and run.kwargs["name"] == "r1"
    assert run.kwargs["config"] == config and run.kwargs["dir"] == str(tmp_path)
    assert "mode" not in run.kwargs  # left to wandb, which reads WANDB_MODE
    assert run.logged == [({"loss": 2.0}, 10)]
    assert run.summary == {"loss": 2.0, "step": 10}  # final metrics, written before finish
    assert run.finished
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 10, "loss": 2.0, "nsp_loss": pytest.approx(float("nan"), nan_ok=True)}
    ]
    # A resumed run reconnects to the same W&B run.
    MetricsLogger(tmp_path, config, backend="wandb", project="proj").close()
    assert runs[1].kwargs["id"] == "run123" and runs[1].kwargs["resume"] == "allow"


def test_plot_metrics_writes_png(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, {}) as logger:
        for step in range(1, 51):
            record = fake_record(step)
            if step > 10:
                record["loss_scale"] = 2.0 ** (10 + step // 20)
            logger.log(record, step=step)
        logger.log(fake_record(30), step=30)  # a resumed run re-logs a step
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "metrics.png")
    assert out == tmp_path / "plots" / "metrics.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp")]


def test_plot_with_partial_keys(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s}) + "\n" for s in (1, 2, 3)))
    assert plot_metrics(path, tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)


def test_plot_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        plot_metrics(tmp_path / "missing.jsonl", tmp_path / "p.png")
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    with pytest.raises(UsageError, match="no logged steps"):
        plot_metrics(empty, tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()

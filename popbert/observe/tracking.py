"""Metrics logging: one JSON line per log step in `metrics.jsonl`, optionally mirrored to W&B.

The JSONL file is the source of truth (plots, tests and resumed runs read it); it is flushed after
every line so a killed run keeps every step it logged. Weights & Biases is optional and imported
only when asked for; it works without an account in its offline mode (``WANDB_MODE=offline``:
the run is written under ``WANDB_DIR`` or the run directory, for ``wandb sync`` later).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from popbert.atomic import DISK_ERRNOS, atomic_write_text, write_error
from popbert.config.sections import TrackingConfig
from popbert.errors import ConfigError, one_line
from popbert.rules import rule_of
from popbert.textfile import decode

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
_WANDB_ID_FILE = "wandb_run_id"


def _jsonable(value: Any) -> Any:
    """Plain Python value for numpy/torch scalars and small arrays; str() for anything else."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


class MetricsLogger:
    """Append metrics dicts to `<output_dir>/metrics.jsonl` and, with backend "wandb", to W&B.

    `backend`, `project`, `run_name`, `group` and `log_checkpoint` default to the config's
    ``tracking`` section (`config_dict["tracking"]`), so every job that hands its config over is
    tracked the way its config says. In W&B the run carries the whole config; on close its
    summary gets the final value of every metric and, with `log_checkpoint`, the run's newest
    checkpoint is uploaded as a "model" artifact. Runs of one sweep share a `group`.

    On resume (``resume_step``) the file is first cut back to the records up to that step, then
    appended to: the steps trained after the checkpoint and lost in the crash are trained again,
    and a run's history stays one line per step.
    """

    def __init__(self, output_dir: str | os.PathLike[str], config_dict: Mapping[str, Any],
                 backend: str | None = None, project: str | None = None,
                 run_name: str | None = None, resume_step: int | None = None,
                 group: str | None = None, log_checkpoint: bool | None = None) -> None:
        section = config_dict.get("tracking")
        tracking: Mapping[str, Any] = section if isinstance(section, Mapping) else {}
        backend = backend if backend is not None else tracking.get("backend") or "none"
        rule = rule_of(TrackingConfig, "backend")
        if rule is not None and not rule.allows(backend):
            raise ConfigError(rule.message("tracking.backend", backend))
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self.backend = backend
        self.log_checkpoint = bool(log_checkpoint if log_checkpoint is not None
                                   else tracking.get("log_checkpoint", False))
        if resume_step is not None and self.path.is_file():
            truncate_metrics(self.path, resume_step)
        self._wandb_run: Any = None
        self._wandb: Any = None
        self._final: dict[str, Any] = {}  # the last value of each metric, for the W&B summary
        if backend == "wandb":
            self._wandb_run = self._init_wandb(
                dict(config_dict),
                project if project is not None else tracking.get("project") or "popbert",
                run_name if run_name is not None else tracking.get("run_name"),
                group if group is not None else tracking.get("group"))
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _init_wandb(self, config: dict[str, Any], project: str, run_name: str | None,
                    group: str | None) -> Any:
        try:
            import wandb
        except ImportError:
            raise ConfigError("tracking.backend is 'wandb' but wandb is not installed: "
                              "pip install wandb (or set tracking.backend=none)") from None
        self._wandb = wandb
        # A resumed run reconnects to its W&B run through the id saved next to the metrics.
        id_file = self.output_dir / _WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        options: dict[str, Any] = {"project": project, "name": run_name, "config": config,
                                   "id": run_id, "resume": "allow" if run_id else None}
        if group:
            options["group"] = group
        if not os.environ.get("WANDB_DIR"):  # WANDB_DIR, when set, says where runs go
            options["dir"] = str(self.output_dir)
        # mode is left to wandb, which honours WANDB_MODE (online / offline / disabled).
        errors = getattr(getattr(wandb, "errors", None), "Error", None)
        try:
            run = wandb.init(**options)
        except Exception as error:
            if isinstance(errors, type) and isinstance(error, errors):
                # Typically no account in online mode: one line that says how to go on.
                raise ConfigError(f"tracking.backend wandb: {one_line(error)} "
                                  f"(WANDB_MODE=offline logs without an account)") from None
            raise
        new_id = getattr(run, "id", None)
        if new_id and new_id != run_id:
            atomic_write_text(id_file, str(new_id))
        logger.info("logging to W&B project %s%s (mode %s)", project,
                    f", group {group}" if group else "", os.environ.get("WANDB_MODE", "online"))
        return run

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> dict[str, Any]:
        """Write one record; `step` (or `metrics["step"]`) is the optimizer step. Returns it."""
        if self._file is None:
            raise ValueError("MetricsLogger.log() after close()")
        record: dict[str, Any] = {}
        if step is not None:
            record["step"] = int(step)
        for key, value in metrics.items():
            record[str(key)] = _jsonable(value)
        if "step" not in record:
            raise ValueError("metrics need a step: pass step= or a 'step' key")
        # NaN/inf are written as JSON NaN/Infinity (Python's json reads them back), so a
        # diverged loss is recorded rather than dropped.
        self._append(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            payload = {k: v for k, v in record.items() if k != "step"
                       and not (isinstance(v, float) and math.isnan(v))}
            self._wandb_run.log(payload, step=record["step"])
            self._final.update(payload)
            self._final["step"] = record["step"]
        return record

    def _append(self, line: str) -> None:
        """Write one line whole or not at all: a full disk cuts the file back to where it was
        (a torn line would join the next one a resumed run writes) and is a `WriteError`."""
        assert self._file is not None
        size = os.fstat(self._file.fileno()).st_size
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as error:
            file, self._file = self._file, None
            fd = os.dup(file.fileno())
            try:
                with contextlib.suppress(OSError):
                    file.close()  # its buffer cannot be flushed either (or only in part)
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            if error.errno in DISK_ERRNOS:
                raise write_error(self.path, error) from None
            raise

    def summarize(self, results: Mapping[str, Any], prefix: str = "eval_") -> None:
        """End-of-run results (a fine-tuning evaluation) for the W&B run's summary, as
        `<prefix><name>`; not a training record, so not in metrics.jsonl (they have their own
        file, eval_results.json)."""
        if self._wandb_run is not None:
            self._final.update({f"{prefix}{k}": _jsonable(v) for k, v in results.items()})

    def close(self, checkpoint: str | os.PathLike[str] | None = None) -> None:
        """Close the file and finish the W&B run (final metrics into its summary; with
        `log_checkpoint`, `checkpoint` or else the run's newest one as an artifact); safe to call
        twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            try:
                if self._final:
                    run.summary.update(self._final)
                if self.log_checkpoint:
                    self._log_checkpoint(run, checkpoint)
            finally:
                run.finish()

    def _log_checkpoint(self, run: Any, checkpoint: str | os.PathLike[str] | None) -> None:
        from popbert.io.run_dir import checkpoint_dirs

        if checkpoint is None:
            found = checkpoint_dirs(self.output_dir)
            if not found:
                logger.warning("tracking.log_checkpoint: %s has no checkpoint to upload",
                               self.output_dir)
                return
            checkpoint = found[-1]
        path = Path(checkpoint)
        artifact = self._wandb.Artifact(f"checkpoint-{run.id}", type="model",
                                        metadata={"step": self._final.get("step"),
                                                  "checkpoint": path.name})
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        run.log_artifact(artifact, aliases=["latest", path.name])
        logger.info("logged %s to W&B as artifact %s", path, artifact.name)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def truncate_metrics(path: str | os.PathLike[str], last_step: int) -> int:
    """Drop the records after ``last_step`` (atomically); returns how many were dropped. A torn
    last line (a full disk, a power cut) goes too, so the next record starts a line."""
    records = read_metrics(path)
    kept = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= last_step]
    text = Path(path).read_bytes()
    if len(kept) != len(records) or (text and not text.endswith(b"\n")):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl, skipping a torn last line left by a killed run."""
    records: list[dict[str, Any]] = []
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = decode(raw, path, "metrics JSON lines", offset=offset).strip()
            offset += len(raw)
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d: skipping unreadable line", path, lineno)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


__all__ = ["METRICS_FILE", "MetricsLogger", "read_metrics", "truncate_metrics"]

"""The main job: config → data → BERT graph → TrainingSession → steps → checkpoints → export.

`run_pretraining` checks everything it can (config, device, output directory, data, vocabulary,
resume checkpoint) before writing anything, so a bad input leaves no half-written output
directory behind. `--resume DIR` continues in DIR; `metrics.jsonl` is cut back to the resumed
step, so every step is logged once.

Under `torchrun` every process is one replica (`execution.replicas`, see docs/scaling.md): each
reads its share of every global batch, only replica 0 writes outputs (config, metrics,
checkpoints, export, plot), and all replicas take the same steps, so they stop together.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from popbert.atomic import atomic_write_bytes, atomic_write_text
from popbert.backends import BackendUnavailable, import_popart
from popbert.backends.popart import check_run_config
from popbert.builders.bert import build_bert
from popbert.config import RunConfig, config_from_dict, dump_config
from popbert.data.loader import PretrainingLoader
from popbert.data.pretraining import (
    ShardSet,
    load_training_data,
    load_validation_data,
    make_loader,
    validation_batches,
)
from popbert.distributed import (
    Replicas,
    agree,
    check_world_size,
    init_replicas,
    replica_seed,
    world_size_from_env,
)
from popbert.errors import CheckpointError, ConfigError
from popbert.io import checkpoint as ckpt
from popbert.io import run_dir
from popbert.observe.plots import plot_metrics
from popbert.observe.tracking import MetricsLogger, read_metrics
from popbert.optimizers import set_lr
from popbert.runtime.devices import resolve_device
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession
from popbert.train.factories import graph_batch_size, loss_scaler, lr_schedule, optimizer_factory
from popbert.train.loop import (
    Checkpointing,
    RecordHook,
    RunStopped,
    TrainingDiverged,
    save_final,
    train_loop,
)

log = logging.getLogger(__name__)

METRIC_KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
METRIC_KEYS = METRIC_KEYS + tuple(f"val_{k}" for k in METRIC_KEYS)


@dataclass
class RunResult:
    output_dir: Path
    checkpoint: Path
    inference_model: Path
    plot: Path
    final_metrics: dict[str, float]
    steps_trained: int = 0


def check_supported(cfg: RunConfig) -> None:
    """What this machine or backend cannot run, said before anything starts: the PopART backend
    where Graphcore's SDK is not importable, or a setting it cannot translate."""
    e = cfg.execution
    if e.backend == "popart":
        try:
            import_popart()
        except BackendUnavailable as error:
            raise BackendUnavailable(f"execution.backend is 'popart': {error}") from None
        check_run_config(cfg)
    if e.recompute and not e.pipeline:
        m = cfg.model
        checkpoints = sum(max(n - 1, 0) for n in m.layers_per_ipu or []) if m.recompute else 0
        if not checkpoints:
            raise ConfigError(
                "execution.recompute needs checkpoints in the graph: set model.recompute=true "
                "and model.layers_per_ipu with a device holding 2+ layers (a checkpoint goes on "
                f"every layer output except each device's last; got model.recompute="
                f"{str(m.recompute).lower()}, model.layers_per_ipu={m.layers_per_ipu}), or "
                "execution.pipeline=true")
    if e.backend == "torch":
        resolve_device(e.device)  # a device that is not there: one line, now


def run_pretraining(cfg: RunConfig, output_dir: Path, resume: Path | None = None,
                    init_from: Path | None = None, *,
                    replicas: Replicas | None = None,
                    on_record: RecordHook | None = None) -> RunResult:
    """Train `cfg` for `training.steps` total steps, writing everything into `output_dir`.

    Under torchrun this process is one of `execution.replicas` replicas; `replicas` may instead
    name the process group of a program that set torch.distributed up itself.
    `on_record`: see `train_loop` (a sweep's pruner); a run it stops raises `RunStopped` and
    keeps its metrics and plot.
    """
    check_supported(cfg)
    if cfg.execution.backend == "popart":  # PopART runs every replica from this one process
        if (replicas.size if replicas is not None else world_size_from_env()) != 1:
            raise ConfigError("execution.backend 'popart' runs its execution.replicas inside "
                              "one process: start it once, not under torchrun")
        replicas = replicas or Replicas.single()
    elif replicas is None:
        check_world_size(cfg, world_size_from_env())
    elif replicas.size != cfg.execution.replicas:
        raise ConfigError(f"execution.replicas is {cfg.execution.replicas} but the given "
                          f"process group has {replicas.size} replicas")
    output_dir = Path(output_dir)
    run_dir.check_output_dir(output_dir)
    restored = ckpt.load_checkpoint(resume) if resume is not None else None
    initial = ckpt.load_checkpoint(init_from, weights_only=True) if init_from else None
    if restored is not None and restored.step >= cfg.training.steps:
        raise ConfigError(f"training.steps is {cfg.training.steps} but the checkpoint {resume} "
                          f"is already at step {restored.step}; raise training.steps")
    if cfg.execution.threads:
        torch.set_num_threads(cfg.execution.threads)
    data = load_training_data(cfg)
    held_out = load_validation_data(cfg)
    owned = replicas is None
    replicas = (init_replicas(cfg, resolve_device(cfg.execution.device)) if replicas is None
                else replicas)
    try:
        result = _run(cfg, output_dir, restored, initial, data, replicas, held_out,
                      on_record)
    except BaseException:
        if owned:
            replicas.shutdown(clean=False)
        raise
    if owned:
        replicas.shutdown()
    return result


def _run(cfg: RunConfig, output_dir: Path, restored: ckpt.Checkpoint | None,
         initial: ckpt.Checkpoint | None, data: dict[str, np.ndarray] | ShardSet,
         replicas: Replicas, held_out: dict[str, np.ndarray] | ShardSet | None = None,
         on_record: RecordHook | None = None) -> RunResult:
    torch.manual_seed(cfg.training.seed)
    # PopART compiles for one micro batch: the popart dialect's inputs have it as their batch.
    graph = build_bert(cfg.model, seed=cfg.training.seed, batch_size=graph_batch_size(cfg))
    model = graph.model()
    session = TrainingSession(model, graph.loss, optimizer_factory(cfg),
                              SessionOptions.from_config(cfg, replicas),
                              loss_scaler=loss_scaler(cfg), replicas=replicas)
    schedule = lr_schedule(cfg)
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    if replicas.rank:  # every replica its own dropout masks (replica 0 as a 1-process run)
        torch.manual_seed(replica_seed(cfg.training.seed, replicas.rank))
    loader = make_loader(cfg, data, replicas.rank, replicas.size)
    validation = validation_batches(cfg, held_out, replicas.rank, replicas.size)
    if initial is not None:
        session.load_weights(matching_weights(initial.weights, session), strict=False)
    if restored is not None:
        restore(session, loader, restored)
    agree(replicas, "(start step, training.steps, global batch, samples)",
          (session.step, cfg.training.steps, cfg.global_batch_size, loader.num_samples))

    created = False
    if replicas.is_main:
        created = run_dir.create_output_dir(output_dir)
        run_dir.clean_interrupted(output_dir)
    try:
        return _train(cfg, output_dir, session, loader, model, schedule, restored is not None,
                      validation, on_record)
    except (TrainingDiverged, RunStopped):
        raise  # the metrics and the plot of a diverged or stopped run are worth keeping
    except BaseException:
        if replicas.is_main:
            run_dir.remove_if_empty_run(output_dir, created)
        raise


def matching_weights(weights: dict[str, torch.Tensor], session: TrainingSession) -> dict:
    """Weights for a new run from another run's checkpoint (phase 1 → phase 2): those whose name
    and shape fit; the rest start fresh, and the log says which."""
    ours = dict(session.named_parameters)
    kept = {k: v for k, v in weights.items() if k in ours and v.shape == ours[k].shape}
    mismatched = [f"{k} {tuple(v.shape)} vs {tuple(ours[k].shape)}"
                  for k, v in weights.items() if k in ours and v.shape != ours[k].shape]
    fresh = sorted(set(ours) - set(kept))
    if mismatched:
        log.warning("--init-from: shapes differ, initialised fresh: %s", "; ".join(mismatched))
    if fresh:
        log.info("--init-from: %d of %d weights initialised fresh: %s", len(fresh), len(ours),
                 ", ".join(fresh[:8]) + (" ..." if len(fresh) > 8 else ""))
    return kept


def restore(session: TrainingSession, loader: PretrainingLoader,
            restored: ckpt.Checkpoint) -> None:
    """Put the run's stateful parts back where the checkpoint left them."""
    state = restored.state()
    session.load_state_dict(state["session"])
    try:
        loader.load_state_dict(state["loader"])
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"checkpoint's data position does not fit this run's data: "
                              f"{' '.join(str(error).split())[:300]}") from None
    log.info("resumed from step %d", restored.step)


def batches(loader: PretrainingLoader, micro_batches: int) -> Iterator[dict[str, torch.Tensor]]:
    """What one `session.run` takes: `device_iterations × gradient_accumulation` micro-batches."""
    while True:
        parts = [next(loader) for _ in range(micro_batches)]
        yield {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _train(cfg: RunConfig, output_dir: Path, session: TrainingSession,
           loader: PretrainingLoader, model, schedule, resumed: bool,
           validation: list[dict] | None = None, on_record: RecordHook | None = None
           ) -> RunResult:
    main = session.replicas.is_main
    config_yaml = dump_config(cfg)
    tracker = None
    if main:
        atomic_write_text(output_dir / "config.yaml", config_yaml)
        atomic_write_bytes(output_dir / "model.onnx", model.SerializeToString())
        tracker = MetricsLogger(output_dir, cfg.to_dict(), backend=cfg.tracking.backend,
                                project=cfg.tracking.project, run_name=cfg.tracking.run_name,
                                resume_step=session.step if resumed else None)
    t = cfg.training
    checkpointing = checkpointing_for(cfg, output_dir, session, loader, config_yaml, model)
    plot = output_dir / "metrics.png"
    try:
        result = train_loop(session, batches(loader, session.micro_batches_per_run()),
                            steps=t.steps, log_every=t.log_every, schedule=schedule,
                            tracker=tracker, samples_per_step=cfg.global_batch_size,
                            checkpointing=checkpointing, desc="pretrain",
                            divergence_factor=t.divergence_factor, validation=validation,
                            eval_every=t.eval_every if validation else 0,
                            on_record=on_record)
        last_checkpoint = save_final(session, checkpointing)
    finally:
        if tracker is not None:
            tracker.close()
            plot = plot_if_logged(output_dir / "metrics.jsonl", plot)
    final = {k: v for k, v in result.record.items() if k in METRIC_KEYS}
    inference = output_dir / "model.inference.onnx"
    if not main:
        return RunResult(output_dir, last_checkpoint, inference, plot, final,
                         result.steps_trained)

    from popbert.io.export import export_weights

    inference = export_weights(session.weights(), cfg.model, "pretraining", inference)
    log.info("output: %s (checkpoint %s, inference model %s, plot %s)", output_dir,
             last_checkpoint.name, inference.name, plot.name)
    return RunResult(output_dir, last_checkpoint, inference, plot, final, result.steps_trained)


def plot_if_logged(metrics: Path, plot: Path) -> Path:
    """Plot the metrics when any step was logged; a run that failed (or diverged) still gets its
    plot, and a plotting problem never hides the run's own error."""
    if not metrics.is_file() or not read_metrics(metrics):
        return plot
    try:
        return plot_metrics(metrics, plot)
    except Exception as error:  # the run's result matters more than its picture
        log.warning("could not plot %s: %s", metrics, error)
        return plot


def checkpointing_for(cfg: RunConfig, output_dir: Path, session: TrainingSession,
                      loader: PretrainingLoader, config_yaml: str, model) -> Checkpointing:
    """How the main job checkpoints: every `training.checkpoint_every` steps into
    `output_dir/checkpoints/`, keeping `training.keep_checkpoints` (and the final one); a resumed
    run's newest checkpoint is its last good one. Only replica 0 touches the files."""
    main = session.replicas.is_main
    keep = cfg.training.keep_checkpoints

    def prune(newest_good: Path, final: bool) -> None:
        if main:
            run_dir.prune_checkpoints(output_dir, keep, final=newest_good if final else None)

    def discard(path: Path) -> None:
        if main:
            log.warning("removing %s: the run diverged right after it", path)
            shutil.rmtree(path, ignore_errors=True)

    existing = run_dir.checkpoint_dirs(output_dir) if main and session.step else []
    return Checkpointing(
        every=cfg.training.checkpoint_every,
        save=lambda: save_state(output_dir, session, loader, config_yaml, model),
        prune=prune, discard=discard, last_good=existing[-1] if existing else None)


def save_state(output_dir: Path, session: TrainingSession, loader: PretrainingLoader,
               config_yaml: str, model) -> Path:
    """Checkpoint the run's stateful parts at the session's step: every replica takes part
    (sharded optimizer state and RNG states are gathered), replica 0 writes."""
    state = {"session": session.state_dict(), "loader": loader.state_dict()}
    directory = run_dir.step_dir(output_dir, session.step)
    if not session.replicas.is_main:
        return directory
    return ckpt.save_checkpoint(directory, ckpt.Checkpoint.from_state(state), config_yaml, model)


def config_of_checkpoint(path: Path) -> RunConfig:
    """The resolved config a checkpoint was trained with."""
    restored = ckpt.load_checkpoint(path, weights_only=True)
    return config_from_dict(restored.config, source=str(ckpt.find_checkpoint(path)))


__all__ = ["RunResult", "batches", "check_supported", "checkpointing_for", "config_of_checkpoint",
           "matching_weights", "plot_if_logged", "restore", "run_pretraining", "save_state"]

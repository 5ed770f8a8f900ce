"""The main job: config → data → BERT graph → TrainingSession → steps → checkpoints → export.

`run_pretraining` checks everything it can (config, data, vocabulary, resume checkpoint) before
writing anything, so a bad input leaves no half-written output directory behind.

Under `torchrun` every process is one replica (`execution.replicas`, see docs/scaling.md): each
reads its share of every global batch, only replica 0 writes outputs (config, metrics,
checkpoints, export, plot), and all replicas take the same steps, so they stop together.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from popbert.builders.bert import build_bert
from popbert.config import RunConfig, config_from_dict
from popbert.data.pretraining import load_training_data, make_loader
from popbert.distributed.replicas import (
    Replicas,
    agree,
    check_world_size,
    devices_per_replica,
    init_replicas,
    replica_seed,
    world_size_from_env,
)
from popbert.errors import CheckpointError, ConfigError
from popbert.io import checkpoint as ckpt
from popbert.io.atomic import atomic_write_bytes, atomic_write_text
from popbert.optimizers import AdamW, Lamb, LossScaler, make_schedule, param_groups_by_name, set_lr
from popbert.runtime.session import NamedParameters, SessionOptions, TrainingSession

log = logging.getLogger(__name__)

METRIC_KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")


@dataclass
class RunResult:
    output_dir: Path
    checkpoint: Path
    inference_model: Path
    plot: Path
    final_metrics: dict[str, float]


def optimizer_factory(cfg: RunConfig) -> Callable[[NamedParameters], torch.optim.Optimizer]:
    """Our LAMB / AdamW with Graphcore's per-tensor exclusions (no decay on biases and norms)."""
    o = cfg.optimizer
    stochastic = cfg.execution.stochastic_rounding

    def make(named: NamedParameters) -> torch.optim.Optimizer:
        groups = param_groups_by_name(named, o.weight_decay)
        common = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                      bias_correction=o.bias_correction, max_grad_norm=o.max_grad_norm,
                      stochastic_rounding=stochastic, seed=cfg.training.seed)
        if o.name == "lamb":
            return Lamb(groups, max_trust_ratio=o.max_trust_ratio, **common)
        return AdamW(groups, **common)

    return make


def lr_schedule(cfg: RunConfig) -> Callable[[int], float]:
    o = cfg.optimizer
    if o.lr_schedule:
        return make_schedule("piecewise", piecewise=o.lr_schedule)
    kind = {"linear": "linear", "polynomial": "poly", "none": "constant"}[o.decay]
    # A run shorter than its warmup (a quick `--set training.steps=20` on a preset) warms up
    # over the whole run rather than failing.
    return make_schedule(kind, peak_lr=o.lr, total_steps=cfg.training.steps,
                         warmup_steps=min(o.warmup_steps, cfg.training.steps),
                         warmup_start_lr=o.warmup_start_lr,
                         end_lr=o.end_lr, power=o.power)


def loss_scaler(cfg: RunConfig) -> LossScaler | None:
    o = cfg.optimizer
    if o.loss_scaling == "static":
        return LossScaler.static(o.loss_scale)
    if o.loss_scaling == "dynamic":
        return LossScaler(o.loss_scale, dynamic=True)
    return None


def session_options(cfg: RunConfig, replicas: Replicas | None = None) -> SessionOptions:
    """The session options of `cfg` for this replica (its devices: the replica's GPUs)."""
    e = cfg.execution
    local_rank = replicas.local_rank if replicas is not None else 0
    device, pipeline_devices = e.device, None
    use_cuda = e.device == "cuda" or (e.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        span = devices_per_replica(cfg)
        first = local_rank * span
        available = torch.cuda.device_count()
        device = f"cuda:{first}"
        if e.pipeline:
            if first + span <= available:
                pipeline_devices = [f"cuda:{first + i}" for i in range(span)]
            else:
                log.warning("the pipeline spans %d devices but only %d GPU(s) are visible to "
                            "this replica: every stage runs on %s (the schedule, not a speed-up)",
                            span, max(available - first, 1), device)
    return SessionOptions(device=device, gradient_accumulation=e.gradient_accumulation,
                          device_iterations=e.device_iterations, replication_factor=e.replicas,
                          weight_dtype=e.weight_dtype, compute_dtype=e.compute_dtype,
                          compile=e.compile,
                          replicated_tensor_sharding=e.replicated_tensor_sharding,
                          pipeline=e.pipeline,
                          pipeline_schedule=getattr(e, "pipeline_schedule", "1f1b"),
                          pipeline_devices=pipeline_devices, recompute=e.recompute)


def _check_supported(cfg: RunConfig) -> None:
    e = cfg.execution
    if e.backend != "torch":
        raise ConfigError(f"execution.backend is {e.backend!r}: only 'torch' runs here "
                          "(the PopART backend needs Graphcore's SDK and IPUs)")
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


def run_pretraining(cfg: RunConfig, output_dir: Path, resume: Path | None = None,
                    init_from: Path | None = None, *,
                    replicas: Replicas | None = None) -> RunResult:
    """Train `cfg` for `training.steps` total steps, writing everything into `output_dir`.

    Under torchrun this process is one of `execution.replicas` replicas; `replicas` may instead
    name the process group of a program that set torch.distributed up itself.
    """
    _check_supported(cfg)
    if replicas is None:
        check_world_size(cfg, world_size_from_env())
    elif replicas.size != cfg.execution.replicas:
        raise ConfigError(f"execution.replicas is {cfg.execution.replicas} but the given "
                          f"process group has {replicas.size} replicas")
    output_dir = Path(output_dir)
    restored = ckpt.load_checkpoint(resume) if resume is not None else None
    initial = ckpt.load_checkpoint(init_from, weights_only=True) if init_from else None
    if restored is not None and restored.step >= cfg.training.steps:
        raise ConfigError(f"training.steps is {cfg.training.steps} but the checkpoint {resume} "
                          f"is already at step {restored.step}; raise training.steps")
    if cfg.execution.threads:
        torch.set_num_threads(cfg.execution.threads)
    data = load_training_data(cfg)
    owned = replicas is None
    replicas = init_replicas(cfg) if replicas is None else replicas
    try:
        result = _run(cfg, output_dir, restored, initial, data, replicas)
    except BaseException:
        if owned:
            replicas.shutdown(clean=False)
        raise
    if owned:
        replicas.shutdown()
    return result


def _run(cfg: RunConfig, output_dir: Path, restored: ckpt.Checkpoint | None,
         initial: ckpt.Checkpoint | None, data: dict[str, np.ndarray],
         replicas: Replicas) -> RunResult:
    torch.manual_seed(cfg.training.seed)
    graph = build_bert(cfg.model, seed=cfg.training.seed)
    model = graph.model()
    schedule = lr_schedule(cfg)
    session = TrainingSession(model, graph.loss, optimizer_factory(cfg),
                              session_options(cfg, replicas), loss_scaler=loss_scaler(cfg),
                              replicas=replicas)
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    if replicas.rank:  # every replica its own dropout masks (replica 0 as a 1-process run)
        torch.manual_seed(replica_seed(cfg.training.seed, replicas.rank))
    loader = make_loader(cfg, data, replicas.rank, replicas.size)
    if initial is not None:
        session.load_weights(_matching(initial.weights, session), strict=False)
    if restored is not None:
        _restore(session, loader, restored, replicas)
    agree(replicas, "(start step, training.steps, global batch, samples)",
          (session.step, cfg.training.steps, cfg.global_batch_size, loader.num_samples))

    created = not output_dir.exists()
    if replicas.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _train(cfg, output_dir, session, loader, model, schedule)
    except Exception:
        if replicas.is_main and created and not (output_dir / "checkpoints").exists():
            shutil.rmtree(output_dir, ignore_errors=True)  # nothing worth keeping
        raise


def _matching(weights: dict[str, torch.Tensor], session: TrainingSession) -> dict:
    """Weights for a new run from another run's checkpoint (phase 1 → phase 2)."""
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


def _restore(session: TrainingSession, loader, restored: ckpt.Checkpoint,
             replicas: Replicas) -> None:
    try:
        session.load_weights(restored.weights)
        session.optimizer.load_state_dict(restored.optimizer)
        loader.load_state_dict(restored.loader)
        if session.loss_scaler is not None and restored.loss_scaler:
            session.loss_scaler.load_state_dict(restored.loss_scaler)
    except (KeyError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint does not fit this run's model/optimizer: "
                              f"{' '.join(str(error).split())[:300]}") from None
    ckpt.restore_rng(restored.rng, replicas.rank)
    session.step = restored.step
    log.info("resumed from step %d", restored.step)


def _next_batch(loader, micro_batches: int) -> dict[str, torch.Tensor]:
    parts = [next(loader) for _ in range(micro_batches)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _train(cfg: RunConfig, output_dir: Path, session: TrainingSession, loader, model,
           schedule) -> RunResult:
    from popbert.observe.plots import plot_metrics
    from popbert.observe.tracking import MetricsLogger

    replicas = session.replicas
    main = replicas.is_main
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    tracker = None
    if main:
        atomic_write_text(output_dir / "config.yaml", config_yaml)
        atomic_write_bytes(output_dir / "model.onnx", model.SerializeToString())
        tracker = MetricsLogger(output_dir, cfg.to_dict(), backend=cfg.tracking.backend,
                                project=cfg.tracking.project, run_name=cfg.tracking.run_name)
    t = cfg.training
    per_run = session.micro_batches_per_run()
    samples_per_step = cfg.global_batch_size
    window: dict[str, list[float]] = {}
    record: dict[str, float] = {}
    bar = tqdm(total=t.steps, initial=session.step, desc="pretrain", unit="step",
               dynamic_ncols=True, disable=not main)
    started, window_start = time.perf_counter(), time.perf_counter()
    try:
        while session.step < t.steps:
            batch = _next_batch(loader, per_run)
            outputs = session.run(batch)
            steps_done = outputs["loss"].shape[0]
            for key, values in outputs.items():
                window.setdefault(key, []).extend(values.tolist())
            bar.update(steps_done)
            if session.step % t.log_every < steps_done or session.step >= t.steps:
                elapsed = time.perf_counter() - window_start
                record = {"step": session.step, "lr": schedule(session.step - 1)}
                record.update(_window_means(window, session))
                record["seq_per_s"] = len(window["loss"]) * samples_per_step / max(elapsed, 1e-9)
                if session.loss_scaler is not None:
                    record["skipped_steps"] = session.loss_scaler.skipped_steps
                if tracker is not None:
                    tracker.log(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                mlm_acc=f"{record['mlm_accuracy']:.3f}",
                                seq_s=f"{record['seq_per_s']:.0f}")
                window, window_start = {}, time.perf_counter()
            if t.checkpoint_every and session.step % t.checkpoint_every < steps_done \
                    and session.step < t.steps:
                _save(output_dir, session, loader, config_yaml, model)
    finally:
        bar.close()
        if tracker is not None:
            tracker.close()
    last_checkpoint = _save(output_dir, session, loader, config_yaml, model)
    log.info("trained %d steps in %.1f s", t.steps, time.perf_counter() - started)
    final = {k: v for k, v in record.items() if k in METRIC_KEYS}
    inference = output_dir / "model.inference.onnx"
    plot = output_dir / "metrics.png"
    if not main:
        return RunResult(output_dir, last_checkpoint, inference, plot, final)

    from popbert.io.export import export_weights

    inference = export_weights(session.weights(), cfg.model, "pretraining", inference)
    plot = plot_metrics(output_dir / "metrics.jsonl", plot)
    log.info("output: %s (checkpoint %s, inference model %s, plot %s)", output_dir,
             last_checkpoint.name, inference.name, plot.name)
    return RunResult(output_dir, last_checkpoint, inference, plot, final)


def _window_means(window: dict[str, list[float]], session: TrainingSession) -> dict[str, float]:
    """Each metric's mean over the log window, and over the replicas (one small all-reduce)."""
    means = {k: float(np.mean(v)) for k, v in window.items()}
    replicas = session.replicas
    if not replicas.distributed:
        return means
    device = session.device if session.device.type == "cuda" else torch.device("cpu")
    values = torch.tensor(list(means.values()), dtype=torch.float64, device=device)
    replicas.all_reduce_(values)
    return dict(zip(means, (values / replicas.size).tolist()))


def _save(output_dir: Path, session: TrainingSession, loader, config_yaml: str, model) -> Path:
    """Checkpoint: every replica takes part (sharded optimizer state and RNG states are
    gathered), replica 0 writes."""
    replicas = session.replicas
    rng = ckpt.capture_rng()
    if replicas.distributed:
        rng = ckpt.replica_rng(rng, replicas.all_gather_object(rng))
    state = ckpt.Checkpoint(
        step=session.step, weights=session.weights(),
        optimizer=session.optimizer.state_dict(), loader=loader.state_dict(),
        loss_scaler=session.loss_scaler.state_dict() if session.loss_scaler else {},
        rng=rng)
    directory = ckpt.step_dir(output_dir, session.step)
    if not replicas.is_main:
        return directory
    return ckpt.save_checkpoint(directory, state, config_yaml, model)


def config_of_checkpoint(path: Path) -> RunConfig:
    """The resolved config a checkpoint was trained with."""
    restored = ckpt.load_checkpoint(path, weights_only=True)
    return config_from_dict(restored.config, source=str(ckpt.find_checkpoint(path)))

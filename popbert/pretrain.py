"""The main job: config → data → BERT graph → TrainingSession → steps → checkpoints → export.

`run_pretraining` checks everything it can (config, data, vocabulary, resume checkpoint) before
writing anything, so a bad input leaves no half-written output directory behind.
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

from popbert import checkpoint as ckpt
from popbert.atomic import atomic_write_bytes, atomic_write_text
from popbert.builders.bert import build_bert
from popbert.config import RunConfig, config_from_dict
from popbert.data.pretraining import load_training_data, make_loader
from popbert.errors import CheckpointError, ConfigError
from popbert.optimizers import AdamW, Lamb, LossScaler, make_schedule, param_groups_by_name, set_lr
from popbert.session import NamedParameters, SessionOptions, TrainingSession

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
    return make_schedule(kind, peak_lr=o.lr, total_steps=cfg.training.steps,
                         warmup_steps=o.warmup_steps, warmup_start_lr=o.warmup_start_lr,
                         end_lr=o.end_lr, power=o.power)


def loss_scaler(cfg: RunConfig) -> LossScaler | None:
    o = cfg.optimizer
    if o.loss_scaling == "static":
        return LossScaler.static(o.loss_scale)
    if o.loss_scaling == "dynamic":
        return LossScaler(o.loss_scale, dynamic=True)
    return None


def session_options(cfg: RunConfig) -> SessionOptions:
    e = cfg.execution
    return SessionOptions(device=e.device, gradient_accumulation=e.gradient_accumulation,
                          device_iterations=e.device_iterations, replication_factor=e.replicas,
                          weight_dtype=e.weight_dtype, compute_dtype=e.compute_dtype,
                          compile=e.compile)


def _check_supported(cfg: RunConfig) -> None:
    e = cfg.execution
    if e.backend != "torch":
        raise ConfigError(f"execution.backend is {e.backend!r}: only 'torch' runs here "
                          "(the PopART backend needs Graphcore's SDK and IPUs)")
    unsupported = [k for k in ("pipeline", "replicated_tensor_sharding") if getattr(e, k)]
    if e.replicas != 1:
        unsupported.append("replicas")
    if unsupported:
        raise ConfigError(f"execution.{unsupported[0]} is not supported by this version's torch "
                          "backend yet (single process, no pipelining); unset it")


def run_pretraining(cfg: RunConfig, output_dir: Path, resume: Path | None = None,
                    init_from: Path | None = None) -> RunResult:
    """Train `cfg` for `training.steps` total steps, writing everything into `output_dir`."""
    _check_supported(cfg)
    output_dir = Path(output_dir)
    restored = ckpt.load_checkpoint(resume) if resume is not None else None
    initial = ckpt.load_checkpoint(init_from, weights_only=True) if init_from else None
    if restored is not None and restored.step >= cfg.training.steps:
        raise ConfigError(f"training.steps is {cfg.training.steps} but the checkpoint {resume} "
                          f"is already at step {restored.step}; raise training.steps")
    if cfg.execution.threads:
        torch.set_num_threads(cfg.execution.threads)
    data = load_training_data(cfg)

    torch.manual_seed(cfg.training.seed)
    graph = build_bert(cfg.model, seed=cfg.training.seed)
    model = graph.model()
    schedule = lr_schedule(cfg)
    session = TrainingSession(model, graph.loss, optimizer_factory(cfg), session_options(cfg),
                              loss_scaler=loss_scaler(cfg))
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    loader = make_loader(cfg, data)
    if initial is not None:
        session.load_weights(_matching(initial.weights, session), strict=False)
    if restored is not None:
        _restore(session, loader, restored)

    created = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _train(cfg, output_dir, session, loader, model, schedule)
    except Exception:
        if created and not (output_dir / "checkpoints").exists():
            shutil.rmtree(output_dir, ignore_errors=True)  # nothing worth keeping
        raise


def _matching(weights: dict[str, torch.Tensor], session: TrainingSession) -> dict:
    """Weights for a new run from another run's checkpoint (phase 1 → phase 2)."""
    ours = dict(session.named_parameters)
    return {k: v for k, v in weights.items() if k in ours and v.shape == ours[k].shape}


def _restore(session: TrainingSession, loader, restored: ckpt.Checkpoint) -> None:
    try:
        session.load_weights(restored.weights)
        session.optimizer.load_state_dict(restored.optimizer)
        loader.load_state_dict(restored.loader)
        if session.loss_scaler is not None and restored.loss_scaler:
            session.loss_scaler.load_state_dict(restored.loss_scaler)
    except (KeyError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint does not fit this run's model/optimizer: "
                              f"{' '.join(str(error).split())[:300]}") from None
    ckpt.restore_rng(restored.rng)
    session.step = restored.step
    log.info("resumed from step %d", restored.step)


def _next_batch(loader, micro_batches: int) -> dict[str, torch.Tensor]:
    parts = [next(loader) for _ in range(micro_batches)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _train(cfg: RunConfig, output_dir: Path, session: TrainingSession, loader, model,
           schedule) -> RunResult:
    from popbert.plotting import plot_metrics
    from popbert.tracking import MetricsLogger

    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
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
               dynamic_ncols=True)
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
                record.update({k: float(np.mean(v)) for k, v in window.items()})
                record["seq_per_s"] = len(window["loss"]) * samples_per_step / max(elapsed, 1e-9)
                if session.loss_scaler is not None:
                    record["skipped_steps"] = session.loss_scaler.skipped_steps
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
        tracker.close()
    last_checkpoint = _save(output_dir, session, loader, config_yaml, model)
    log.info("trained %d steps in %.1f s", t.steps, time.perf_counter() - started)

    from popbert.export import export_weights

    inference = export_weights(session.weights(), cfg.model, "pretraining",
                               output_dir / "model.inference.onnx")
    plot = plot_metrics(output_dir / "metrics.jsonl", output_dir / "metrics.png")
    final = {k: v for k, v in record.items() if k in METRIC_KEYS}
    log.info("output: %s (checkpoint %s, inference model %s, plot %s)", output_dir,
             last_checkpoint.name, inference.name, plot.name)
    return RunResult(output_dir, last_checkpoint, inference, plot, final)


def _save(output_dir: Path, session: TrainingSession, loader, config_yaml: str, model) -> Path:
    state = ckpt.Checkpoint(
        step=session.step, weights=session.weights(),
        optimizer=session.optimizer.state_dict(), loader=loader.state_dict(),
        loss_scaler=session.loss_scaler.state_dict() if session.loss_scaler else {},
        rng=ckpt.capture_rng())
    return ckpt.save_checkpoint(ckpt.step_dir(output_dir, session.step), state, config_yaml,
                                model)


def config_of_checkpoint(path: Path) -> RunConfig:
    """The resolved config a checkpoint was trained with."""
    restored = ckpt.load_checkpoint(path, weights_only=True)
    return config_from_dict(restored.config, source=str(ckpt.find_checkpoint(path)))

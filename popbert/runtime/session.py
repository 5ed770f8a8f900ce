"""Sessions: the one way to run a graph. `TrainingSession` trains it, `InferenceSession` runs it.

The torch backend lowers the ONNX proto once into a `torch.fx.GraphModule` whose parameters are
the graph's initializers under their ONNX names, then runs optimizer steps with autograd.
One `run()` performs `device_iterations` optimizer steps, each accumulating gradients over
`gradient_accumulation` micro-batches (mean reduction, as PopART's accumulation does).

Scale-out options (see docs/scaling.md): `replication_factor` replicas, one process each, given
as a `popbert.distributed.replicas.Replicas` (gradients mean-reduced); `replicated_tensor_sharding`
(optimizer state and accumulated gradient sharded over the replicas,
`popbert.distributed.replicas.ShardedOptimizer`); `pipeline` (the graph split at its `__pipeline_stage`
annotations, micro-batches scheduled through the stages, `popbert.runtime.pipeline`); `recompute`
(activation checkpointing between the graph's checkpoint annotations). With none of them a
session runs exactly as a plain single-process loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch

from popbert.graph.annotations import constant_initializers
from popbert.optimizers import LossScaler

if TYPE_CHECKING:
    from popbert.distributed.replicas import Replicas

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NamedParameters = list[tuple[str, torch.nn.Parameter]]
OptimizerFactory = Callable[[NamedParameters], torch.optim.Optimizer]


@dataclass
class SessionOptions:
    """Execution options (PopART's `SessionOptions`, for what the torch backend honours)."""

    device: str = "cpu"
    gradient_accumulation: int = 1
    device_iterations: int = 1
    replication_factor: int = 1
    weight_dtype: str = "float32"
    compute_dtype: str = "float32"
    compile: bool = False
    seed: int | None = None
    replicated_tensor_sharding: bool = False
    pipeline: bool = False
    pipeline_schedule: str = "1f1b"  # or "gpipe"
    # Device of each `__ipu_number` when pipelining (index = ipu); None: all on `device`.
    pipeline_devices: list[str] | None = None
    # Worker thread per device when pipelining: None = when the stages span several devices.
    pipeline_threads: bool | None = None
    recompute: bool = False

    def validate(self) -> None:
        from popbert.runtime.pipeline import SCHEDULES

        for key in ("gradient_accumulation", "device_iterations", "replication_factor"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"SessionOptions.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("weight_dtype", "compute_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"SessionOptions.{key} must be one of {sorted(DTYPES)}, "
                                 f"got {getattr(self, key)!r}")
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"SessionOptions.pipeline_schedule must be one of {SCHEDULES}, "
                             f"got {self.pipeline_schedule!r}")


def load_model(model: onnx.ModelProto | bytes | str | Path) -> onnx.ModelProto:
    """Accept a ModelProto, serialized bytes (what `Builder.getModelProto()` returns) or a path."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(str(model))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"execution.device is {device!r} but CUDA is not available here")
    return torch.device(device)


class _Session:
    def __init__(self, model, options: SessionOptions | None, training: bool):
        from popbert.lowering import lower_to_fx

        self.options = options or SessionOptions()
        self.options.validate()
        self.proto = load_model(model)
        self.device = resolve_device(self.options.device)
        if self.options.seed is not None:
            torch.manual_seed(self.options.seed)
        self.module = lower_to_fx(self.proto, trainable=training)
        frozen = constant_initializers(self.proto)
        for name, param in self.module.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        weight_dtype = DTYPES[self.options.weight_dtype]
        self.module.to(self.device)
        self._half_weights = weight_dtype != torch.float32
        # Pipelining / recomputation run the graph split at its annotations (popbert.runtime.pipeline).
        self.program = None
        if self.options.pipeline or (self.options.recompute and training):
            self.program = self._make_program(training)
            with torch.no_grad():
                for name, param in self.module.named_parameters():
                    device = self.program.param_devices.get(name, self.device)
                    if param.device != device:
                        param.data = param.data.to(device)
        if weight_dtype != torch.float32:
            for name, param in self.module.named_parameters():
                if name not in frozen:
                    param.data = param.data.to(weight_dtype)
        self.input_names = list(self.module.input_names)
        self.output_names = list(self.module.output_names)
        self._forward = torch.compile(self.module) if self.options.compile else self.module
        self._compute_dtype = DTYPES[self.options.compute_dtype]

    def _make_program(self, training: bool):
        from popbert.runtime.pipeline import Program

        devices = self.options.pipeline_devices

        def device_of_ipu(ipu: int) -> torch.device:
            if not devices:
                return self.device
            if ipu >= len(devices):
                raise ValueError(f"the graph places a stage on device {ipu} but only "
                                 f"{len(devices)} pipeline device(s) are given: {devices}")
            return resolve_device(devices[ipu])

        return Program(self.module, pipeline=self.options.pipeline,
                       recompute=self.options.recompute and training, device=self.device,
                       device_of_ipu=device_of_ipu, cast_params=self._half_weights,
                       compile=self.options.compile)

    def _autocast(self):
        if self._compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._compute_dtype)

    def _feeds(self, batch: Mapping[str, torch.Tensor | np.ndarray]) -> list[torch.Tensor]:
        missing = [n for n in self.input_names if n not in batch]
        if missing:
            raise KeyError(f"batch is missing graph input(s) {missing}; "
                           f"the graph takes {self.input_names}")
        return [torch.as_tensor(batch[n]).to(self.device, non_blocking=True)
                for n in self.input_names]

    def forward(self, batch: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
        feeds = self._feeds(batch)
        with self._autocast():
            if self.program is not None:  # reads half weights as FP32 views itself
                outputs = self.program(*feeds)
            elif self._half_weights:
                # Weights are stored in FP16/BF16 only (no master copy); the graph computes from
                # FP32 views of them (autocast then lowers matmuls to the compute dtype), and
                # gradients flow back through the casts into the half-precision weights.
                views = {n: p.float() for n, p in self.module.named_parameters()}
                outputs = torch.func.functional_call(self._forward, views, tuple(feeds))
            else:
                outputs = self._forward(*feeds)
        return dict(zip(self.output_names, outputs))

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights under their ONNX names (detached views)."""
        frozen = constant_initializers(self.proto)
        return {n: p.detach() for n, p in self.module.named_parameters() if n not in frozen}

    def load_weights(self, weights: Mapping[str, torch.Tensor | np.ndarray],
                     strict: bool = True) -> None:
        params = dict(self.module.named_parameters())
        unknown = sorted(set(weights) - set(params))
        if unknown and strict:
            raise KeyError(f"weights not in the graph: {unknown[:5]}")
        with torch.no_grad():
            for name, value in weights.items():
                if name not in params:
                    continue
                value = torch.as_tensor(value)
                if tuple(value.shape) != tuple(params[name].shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(value.shape)} does not match "
                                     f"the graph's {tuple(params[name].shape)}")
                params[name].copy_(value.to(params[name].dtype))


class InferenceSession(_Session):
    """Run a graph forward without gradients (dropout off)."""

    def __init__(self, model, options: SessionOptions | None = None):
        super().__init__(model, options, training=False)
        self.module.eval()

    @torch.no_grad()
    def run(self, batch: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
        return self.forward(batch)


class TrainingSession(_Session):
    """Train a graph: `run(batch)` does `device_iterations` optimizer steps.

    `optimizer` is a factory taking the named trainable parameters (ONNX names), so optimizers
    can apply per-tensor options by name (no weight decay on biases and norms, ...).
    """

    def __init__(self, model, loss: str, optimizer: OptimizerFactory,
                 options: SessionOptions | None = None,
                 step_hook: Callable[[int], None] | None = None,
                 loss_scaler: LossScaler | None = None,
                 replicas: Replicas | None = None):
        from popbert.distributed.replicas import (
            GradientBuffer,
            Replicas,
            ShardedOptimizer,
            broadcast_parameters,
        )

        super().__init__(model, options, training=True)
        if loss not in self.output_names:
            raise ValueError(f"loss {loss!r} is not a graph output; outputs are "
                             f"{self.output_names}")
        self.loss_name = loss
        self.module.train()
        self.replicas = replicas if replicas is not None else Replicas.single()
        if self.replicas.size != self.options.replication_factor:
            raise ValueError(f"SessionOptions.replication_factor is "
                             f"{self.options.replication_factor} but the replicas given number "
                             f"{self.replicas.size}")
        frozen = constant_initializers(self.proto)
        self.named_parameters: NamedParameters = [
            (n, p) for n, p in self.module.named_parameters() if n not in frozen]
        # Every replica starts from replica 0's weights.
        broadcast_parameters([p for _, p in self.named_parameters], self.replicas)
        self.optimizer = optimizer(self.named_parameters)
        self._grads: GradientBuffer | None = None
        if self.options.replicated_tensor_sharding:
            self.optimizer = ShardedOptimizer(self.optimizer, self.replicas)
        elif self.replicas.distributed:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self._grads = GradientBuffer(params, self.replicas)
        self.engine = None
        if self.options.pipeline:
            from popbert.runtime.pipeline import PipelineEngine

            self.engine = PipelineEngine(self.program, self.options.pipeline_schedule,
                                         autocast=self._autocast,
                                         threads=self.options.pipeline_threads)
            if self.options.gradient_accumulation < self.program.num_stages:
                log.warning("pipeline of %d stages fed %d micro-batches per step: most stages "
                            "idle (raise gradient_accumulation to several times the stages)",
                            self.program.num_stages, self.options.gradient_accumulation)
        self.step = 0
        # Called before each optimizer step with the step index (learning-rate schedules).
        self.step_hook = step_hook
        self.loss_scaler = loss_scaler

    @property
    def sharded(self) -> bool:
        """Whether optimizer state and gradients are sharded over the replicas (RTS)."""
        return self.options.replicated_tensor_sharding

    def micro_batches_per_run(self) -> int:
        return self.options.device_iterations * self.options.gradient_accumulation

    def _split(self, batch: Mapping[str, torch.Tensor | np.ndarray]) -> list[list[dict]]:
        """[iterations × accumulation × micro, ...] → nested lists of micro-batch dicts."""
        iterations, accumulation = (self.options.device_iterations,
                                    self.options.gradient_accumulation)
        first = torch.as_tensor(batch[self.input_names[0]])
        total = first.shape[0]
        if total % (iterations * accumulation):
            raise ValueError(f"batch of {total} samples does not divide into device_iterations "
                             f"({iterations}) × gradient_accumulation ({accumulation})")
        micro = total // (iterations * accumulation)
        tensors = {n: torch.as_tensor(batch[n]) for n in self.input_names}
        return [[{n: t[(i * accumulation + a) * micro:(i * accumulation + a + 1) * micro]
                  for n, t in tensors.items()}
                 for a in range(accumulation)] for i in range(iterations)]

    def run(self, batch: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
        """Train on `batch`; returns each output averaged per optimizer step: shape [iterations]."""
        per_step: list[dict[str, torch.Tensor]] = []
        for micro_batches in self._split(batch):
            per_step.append(self.train_step(micro_batches))
        return {k: torch.stack([s[k] for s in per_step]) for k in per_step[0]}

    def train_step(self, micro_batches: Iterable[Mapping[str, torch.Tensor]]
                   ) -> dict[str, torch.Tensor]:
        """One optimizer step over the accumulated micro-batches (mean of their gradients, and
        over the replicas)."""
        micro_batches = list(micro_batches)
        if self.step_hook is not None:
            self.step_hook(self.step)
        if self._grads is not None:
            self._grads.zero_()  # data parallel: .grad are views of one flat, reduced buffer
        else:
            self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        scale = self.loss_scaler.scale_value if self.loss_scaler is not None else 1.0
        if self.engine is not None:
            loss_index = self.output_names.index(self.loss_name)
            feeds = [self._feeds(micro) for micro in micro_batches]
            for outputs in self.engine.train(feeds, loss_index, scale):
                _add_scalars(totals, dict(zip(self.output_names, outputs)))
            if self.sharded:
                self.optimizer.accumulate()
        else:
            for micro in micro_batches:
                outputs = self.forward(micro)
                (outputs[self.loss_name].float() * (scale / len(micro_batches))).backward()
                if self.sharded:  # reduce-scatter into the FP32 shard after every micro-batch
                    self.optimizer.accumulate()
                _add_scalars(totals, outputs)
        if self._grads is not None:
            self._grads.all_reduce_mean_()
        if self.sharded:
            found_inf = self.loss_scaler is not None and self.optimizer.found_inf()
            if not found_inf:
                self.optimizer.step(grad_scale=scale if self.loss_scaler is not None else None)
            if self.loss_scaler is not None:
                totals["loss_scale"] = torch.tensor(scale * len(micro_batches))
                self.loss_scaler.update(found_inf)
        elif self.loss_scaler is None:
            self.optimizer.step()
        else:  # skips the step (and backs the scale off) when a gradient overflowed
            totals["loss_scale"] = torch.tensor(scale * len(micro_batches))
            self.loss_scaler.step(self.optimizer)
        self.step += 1
        return {k: v / len(micro_batches) for k, v in totals.items()}


def _add_scalars(totals: dict[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
    """Sum the scalar outputs (loss, accuracies) of one micro-batch into ``totals``."""
    for name, value in outputs.items():
        if value.dim() == 0:
            value = value.detach().float()
            totals[name] = totals[name] + value if name in totals else value

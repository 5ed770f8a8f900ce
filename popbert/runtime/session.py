"""Sessions: the one way to run a graph. `TrainingSession` trains it, `InferenceSession` runs it.

The torch backend: the ONNX proto is lowered once to a `torch.fx.GraphModule` and trained with
autograd; one `run()` performs `device_iterations` optimizer steps of `gradient_accumulation`
micro-batches each, pipelined, recomputed or replicated as `SessionOptions` says. It implements
the `Session` protocol (`popbert.runtime.protocol`); `popbert.backends.make_session` chooses
between it and the PopART session. The step, and why: docs/design.md, section
"popbert.runtime.session" (the choice of backend: section "Backends").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from popbert.distributed import Replicas, broadcast_parameters, gradient_sync
from popbert.dtypes import torch_dtype
from popbert.errors import CheckpointError, InputError, one_line
from popbert.graph.annotations import constant_initializers, loss_mean
from popbert.optimizers import LossScaler
from popbert.runtime.devices import resolve_device
from popbert.runtime.groups import RowGroups
from popbert.runtime.inputs import InputChecker, PaddingTrimmer
from popbert.runtime.options import SessionOptions
from popbert.runtime.partition import Program
from popbert.runtime.protocol import Batch, NamedParameters, OptimizerFactory
from popbert.runtime.rng import capture_rng, replica_rng, restore_rng
from popbert.runtime.schedules import PipelineEngine
from popbert.runtime.texts import TextRows, has_text_rows

log = logging.getLogger(__name__)

STATE_KEYS = ("step", "weights", "optimizer", "loss_scaler", "rng")

__all__ = ["InferenceSession", "NamedParameters", "OptimizerFactory", "SessionOptions",
           "TrainingSession", "load_model"]


def load_model(model: onnx.ModelProto | bytes | str | Path) -> onnx.ModelProto:
    """Accept a ModelProto, serialized bytes (what `Builder.getModelProto()` returns) or a path."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(str(model))


class _Session:
    def __init__(self, model: onnx.ModelProto | bytes | str | Path,
                 options: SessionOptions | None, training: bool):
        from popbert.lowering import lower_to_fx

        self.options = options or SessionOptions()
        self.proto = load_model(model)
        self.device = resolve_device(self.options.device)
        if self.options.seed is not None:
            torch.manual_seed(self.options.seed)
        self.module = lower_to_fx(self.proto, trainable=training)
        self._constants = constant_initializers(self.proto)
        for name, param in self.module.named_parameters():
            if name in self._constants:
                param.requires_grad_(False)
        weight_dtype = torch_dtype(self.options.weight_dtype)
        self.module.to(self.device)
        self._half_weights = weight_dtype != torch.float32
        # Pipelining / recomputation run the graph split at its annotations (runtime.partition).
        self.program: Program | None = None
        if self.options.pipeline or (self.options.recompute and training):
            self.program = self._make_program(training)
            with torch.no_grad():
                for name, param in self.module.named_parameters():
                    device = self.program.param_devices.get(name, self.device)
                    if param.device != device:
                        param.data = param.data.to(device)
        if weight_dtype != torch.float32:
            for name, param in self.module.named_parameters():
                if name not in self._constants:
                    param.data = param.data.to(weight_dtype)
        self.input_names = list(self.module.input_names)
        self.output_names = list(self.module.output_names)
        self.inputs = InputChecker(self.proto, self.input_names)
        # execution.trim_padding: each micro-batch cut to its longest row before it runs.
        self._trim = (PaddingTrimmer(self.inputs.specs) if self.options.trim_padding
                      else _untrimmed)
        # Half weights are stored in FP16/BF16 only (no master copy): the graph computes from
        # FP32 views of them, made inside the (compiled) forward so the casts fuse with it.
        forward = self._from_fp32_views if self._half_weights else self.module
        self._forward = torch.compile(forward) if self.options.compile else forward
        self._compute_dtype = torch_dtype(self.options.compute_dtype)

    def _make_program(self, training: bool) -> Program:
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._compute_dtype)

    def _feeds(self, batch: Batch) -> list[torch.Tensor]:
        """The graph's inputs of a (checked) batch, in order, on the session's device."""
        return [torch.as_tensor(batch[n]).to(self.device, non_blocking=True)
                for n in self.input_names]

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Run the graph on ``batch`` as given (``run`` checks it first)."""
        feeds = self._feeds(batch)
        with self._autocast():
            if self.program is not None:  # reads half weights as FP32 views itself
                outputs = self.program(*feeds)
            else:
                outputs = self._forward(*feeds)
        return dict(zip(self.output_names, outputs))

    def _from_fp32_views(self, *feeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph on FP32 views of the half-precision weights (autocast then lowers matmuls
        to the compute dtype); gradients flow back through the casts into the stored weights."""
        views = {n: p.float() for n, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, views, feeds)

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights under their ONNX names (detached views)."""
        return {n: p.detach() for n, p in self.module.named_parameters()
                if n not in self._constants}

    def load_weights(self, weights: Mapping[str, torch.Tensor | np.ndarray],
                     strict: bool = True) -> None:
        """Copy ``weights`` (ONNX names) into the graph's; ``strict``: unknown names are an
        error. Shapes must match; dtypes are cast to the stored weight dtype."""
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

    def __init__(self, model: onnx.ModelProto | bytes | str | Path,
                 options: SessionOptions | None = None):
        super().__init__(model, options, training=False)
        self.module.eval()

    @torch.no_grad()
    def run(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The graph's outputs for ``batch`` (checked first: an InputError names what is
        wrong)."""
        return self.forward(self.inputs.check(batch))


class TrainingSession(_Session):
    """Train a graph: `run(batch)` does `device_iterations` optimizer steps.

    `optimizer` is a factory taking the named trainable parameters (ONNX names), so optimizers
    can apply per-tensor options by name (no weight decay on biases and norms, ...).

    This is the torch backend's `popbert.runtime.protocol.Session`;
    `popbert.backends.make_session` makes whichever session `SessionOptions.backend` names.
    """

    def __init__(self, model: onnx.ModelProto | bytes | str | Path, loss: str,
                 optimizer: OptimizerFactory, options: SessionOptions | None = None,
                 step_hook: Callable[[int], None] | None = None,
                 loss_scaler: LossScaler | None = None,
                 replicas: Replicas | None = None):
        if options is not None and options.backend != "torch":
            raise ValueError(f"TrainingSession is the torch backend but SessionOptions.backend "
                             f"is {options.backend!r}: make the session with "
                             "popbert.backends.make_session")
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
        self.named_parameters: NamedParameters = [
            (n, p) for n, p in self.module.named_parameters() if n not in self._constants]
        # Every replica starts from replica 0's weights.
        broadcast_parameters([p for _, p in self.named_parameters], self.replicas)
        # How gradients are zeroed, combined over micro-batches and replicas, and applied.
        self.gradients = gradient_sync(optimizer(self.named_parameters), self.replicas,
                                       sharded=self.options.replicated_tensor_sharding)
        self.optimizer = self.gradients.optimizer
        # Who runs the forward and backward passes of a step's micro-batches.
        self.engine: PipelineEngine | None = None
        self._passes = self._plain_passes
        if self.options.pipeline:
            self.engine = PipelineEngine(self.program, self.options.pipeline_schedule,
                                         autocast=self._autocast,
                                         threads=self.options.pipeline_threads)
            self._passes = self._pipelined_passes
            if self.options.gradient_accumulation < self.program.num_stages:
                log.warning("pipeline of %d stages fed %d micro-batches per step: most stages "
                            "idle (raise gradient_accumulation to several times the stages)",
                            self.program.num_stages, self.options.gradient_accumulation)
        # An embedding graph's rows of several texts run text by text, each trimmed to its own
        # longest (and, cached, in chunks): `popbert.runtime.texts`.
        self._rows: TextRows | None = None
        cached = self.options.gradient_cache_rows
        if (self.options.trim_padding or cached) and has_text_rows(self.module,
                                                                   self.output_names):
            if self.program is not None or self._half_weights:
                if cached:
                    raise ValueError("gradient caching (gradient_cache_rows) runs FP32 "
                                     "weights unpipelined, without recomputation")
            else:
                self._rows = TextRows(self.module, self.input_names, self.output_names,
                                      self.device, self.options.trim_padding, cached)
                self._passes = self._text_passes
        if cached and self._rows is None:
            raise ValueError("gradient caching (gradient_cache_rows) needs a graph whose "
                             "'embedding' output a loss follows (an embedding training graph)")
        # A graph whose loss is a mean over rows or labelled tokens runs each micro-batch in
        # groups of rows of similar length (`popbert.runtime.groups`); not compiled (each group
        # is a new shape) and not pipelined (the engine schedules whole micro-batches).
        self._groups: RowGroups | None = None
        mean = loss_mean(self.proto)
        if (self.options.trim_padding and self._rows is None and mean is not None
                and self.engine is None and not self.options.compile):
            self._groups = RowGroups(mean, self._trim.sequence_inputs)
            self._passes = self._grouped_passes
        self.step = 0
        # Called before each optimizer step with the step index (learning-rate schedules).
        self.step_hook = step_hook
        self.loss_scaler = loss_scaler

    @property
    def sharded(self) -> bool:
        """Whether optimizer state and gradients are sharded over the replicas (RTS)."""
        return self.options.replicated_tensor_sharding

    def micro_batches_per_run(self) -> int:
        """Micro-batches one `run()` takes: `device_iterations × gradient_accumulation`."""
        return self.options.device_iterations * self.options.gradient_accumulation

    def run(self, batch: Batch, micro_batches: int | None = None) -> dict[str, torch.Tensor]:
        """Train on `batch` ([iterations × accumulation × micro, ...], checked first: an
        InputError names what is wrong); returns each output averaged per optimizer step:
        shape [iterations].

        `micro_batches`: how many micro-batches each optimizer step takes, 1 to
        `gradient_accumulation` (None: all of them). Fewer while the global batch warms up
        (`training.batch_warmup`); the step's gradient is then the mean over those only."""
        iterations, accumulation = (self.options.device_iterations,
                                    self.options.gradient_accumulation)
        per_run = f" (device_iterations {iterations} × gradient_accumulation {accumulation})"
        if micro_batches is not None:
            if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
                    or not 1 <= micro_batches <= accumulation:
                raise InputError(f"micro_batches is {micro_batches!r}: an optimizer step takes "
                                 f"1 to gradient_accumulation ({accumulation}) micro-batches")
            if micro_batches != accumulation:
                per_run = (f" (device_iterations {iterations} × {micro_batches} of "
                           f"gradient_accumulation {accumulation})")
            accumulation = micro_batches
        tensors = self.inputs.check(batch, iterations * accumulation, per_run)
        total = next(iter(tensors.values())).shape[0]
        if total % (iterations * accumulation):  # a graph that declares no input shapes
            raise InputError(f"batch of {total} samples does not divide into "
                             f"{iterations * accumulation} micro-batches{per_run}")
        micro = total // (iterations * accumulation)
        per_step: list[dict[str, torch.Tensor]] = []
        for i in range(iterations):
            starts = [(i * accumulation + a) * micro for a in range(accumulation)]
            per_step.append(self.train_step(
                [self._trim({n: t[s:s + micro] for n, t in tensors.items()}) for s in starts]))
        return {k: torch.stack([s[k] for s in per_step]) for k in per_step[0]}

    def evaluate(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The graph's outputs for one micro-batch with dropout off and no gradients (validation),
        leaving training exactly as it was: train mode is restored and the RNG states (CPU and
        the session's GPU) are put back, so the next step's dropout masks do not depend on
        whether an evaluation ran. Works on every path `forward` takes: plain, pipelined or
        recomputed (the Program), half-precision weights."""
        tensors = self._trim(self.inputs.check(batch))
        modules = [self.module] + ([self.program.split] if self.program is not None else [])
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for module in modules:
                module.eval()
            try:
                outputs = self.forward(tensors)
            finally:
                for module in modules:
                    module.train()
        return outputs

    def train_step(self, micro_batches: Iterable[Mapping[str, torch.Tensor]]
                   ) -> dict[str, torch.Tensor]:
        """One optimizer step over the accumulated micro-batches (mean of their gradients, and
        over the replicas); returns the scalar outputs averaged over the micro-batches."""
        micro_batches = list(micro_batches)
        if self.step_hook is not None:
            self.step_hook(self.step)
        self.gradients.zero_grad()
        scale = self.loss_scaler.scale_value if self.loss_scaler is not None else 1.0
        totals: dict[str, torch.Tensor] = {}
        for outputs in self._passes(micro_batches, scale):
            _add_scalars(totals, outputs)
            del outputs  # the next micro-batch runs without this one's logits alive
        self.gradients.finish()
        # With a loss scaler a step whose gradients overflowed is skipped (and the scale backs
        # off); without one there is nothing to check.
        found_inf = self.loss_scaler is not None and self.gradients.found_inf()
        if not found_inf:
            self.gradients.step(scale if self.loss_scaler is not None else None)
        if self.loss_scaler is not None:
            totals["loss_scale"] = torch.tensor(scale * len(micro_batches))
            self.loss_scaler.update(found_inf)
        self.step += 1
        return {k: v / len(micro_batches) for k, v in totals.items()}

    def _plain_passes(self, micro_batches: list[Mapping[str, torch.Tensor]],
                      scale: float) -> Iterator[dict[str, torch.Tensor]]:
        """Forward and backward one micro-batch after the other."""
        for micro in micro_batches:
            outputs = self.forward(micro)
            (outputs[self.loss_name].float() * (scale / len(micro_batches))).backward()
            self.gradients.after_micro_batch()
            yield outputs
            del outputs  # not alive while the next micro-batch runs

    def _grouped_passes(self, micro_batches: list[Mapping[str, torch.Tensor]],
                        scale: float) -> Iterator[dict[str, torch.Tensor]]:
        """Each micro-batch in groups of rows of similar length (`popbert.runtime.groups`)."""
        assert self._groups is not None
        for micro in micro_batches:
            outputs = self._groups.step(micro, self.forward, self.loss_name,
                                        scale / len(micro_batches))
            self.gradients.after_micro_batch()
            yield outputs

    def _text_passes(self, micro_batches: list[Mapping[str, torch.Tensor]],
                     scale: float) -> Iterator[dict[str, torch.Tensor]]:
        """Each micro-batch text slot by text slot (and cached in chunks): the encoder, then
        the loss over all the vectors (`popbert.runtime.texts`)."""
        assert self._rows is not None
        for micro in micro_batches:
            with self._autocast():
                outputs = self._rows.step(micro, self.loss_name, scale / len(micro_batches))
            self.gradients.after_micro_batch()
            yield outputs

    def _pipelined_passes(self, micro_batches: list[Mapping[str, torch.Tensor]],
                          scale: float) -> Iterator[dict[str, torch.Tensor]]:
        """All micro-batches through the pipeline schedule (their backward passes interleave,
        so the gradients are handed on once, after all of them)."""
        feeds = [self._feeds(micro) for micro in micro_batches]
        results = self.engine.train(feeds, self.output_names.index(self.loss_name), scale,
                                    scalars_only=True)
        self.gradients.after_micro_batch()
        for outputs in results:
            yield dict(zip(self.output_names, outputs))

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs from the session, as CPU copies (a snapshot: training
        on does not change it): ``step``, ``weights`` (trainable, ONNX names), ``optimizer``
        (under RTS the gathered state in the ordinary optimizer's format), ``loss_scaler``
        ({} without one) and ``rng`` (with replicas: every replica's, under ``replicas``).

        A collective under replicas: every replica must call it.
        """
        optimizer = _cpu_copy(self.optimizer.state_dict())
        rng = capture_rng()
        if self.replicas.distributed:
            rng = replica_rng(rng, self.replicas.all_gather_object(rng))
        return {"step": self.step,
                "weights": {n: _cpu_copy(w) for n, w in self.weights().items()},
                "optimizer": optimizer,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else {},
                "rng": _cpu_copy(rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (from any replica count, sharded or
        not); this replica restores its own RNG states. A state that does not fit this model
        or optimizer is a one-line CheckpointError (the weights and the optimizer state are
        checked before either is loaded)."""
        missing = [k for k in ("step", "weights", "optimizer") if k not in state]
        if missing:
            raise CheckpointError(f"session state lacks {', '.join(missing)} (it holds "
                                  f"{', '.join(map(str, state)) or 'nothing'}; expected "
                                  f"{', '.join(STATE_KEYS)})")
        weights = dict(state["weights"])
        self._check_weights(weights)
        if not state["optimizer"]:
            raise CheckpointError("session state holds no optimizer state (a weights-only "
                                  "checkpoint?): load its weights with load_weights instead")
        try:
            self.optimizer.load_state_dict(_cpu_copy(state["optimizer"]))
        except (KeyError, ValueError, TypeError, RuntimeError) as error:
            raise CheckpointError(f"the optimizer state does not fit this optimizer: "
                                  f"{one_line(error, 300)}") from None
        self.load_weights(weights)
        scaler = state.get("loss_scaler") or {}
        if self.loss_scaler is not None and scaler:
            try:
                self.loss_scaler.load_state_dict(scaler)
            except (KeyError, ValueError, TypeError) as error:
                raise CheckpointError(f"the loss-scaler state is unreadable: "
                                      f"{one_line(error, 300)}") from None
        try:
            restore_rng(state.get("rng") or {}, self.replicas.rank)
        except (KeyError, ValueError, TypeError, RuntimeError) as error:
            raise CheckpointError(f"the RNG state is unreadable: {one_line(error, 300)}") from None
        self.step = int(state["step"])

    def _check_weights(self, weights: Mapping[str, Any]) -> None:
        ours = {n: tuple(w.shape) for n, w in self.weights().items()}
        absent = sorted(set(ours) - set(weights))
        extra = sorted(set(weights) - set(ours))
        if absent or extra:
            parts = []
            if absent:
                parts.append(f"{len(absent)} of this model's weights missing ({_few(absent)})")
            if extra:
                parts.append(f"{len(extra)} weights this model does not have ({_few(extra)})")
            raise CheckpointError(f"the weights do not fit this model: {'; '.join(parts)}")
        for name, shape in ours.items():
            given = tuple(torch.as_tensor(weights[name]).shape)
            if given != shape:
                raise CheckpointError(f"the weights do not fit this model: {name!r} has shape "
                                      f"{given}, this model {shape}")


def _untrimmed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return batch


def _add_scalars(totals: dict[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
    """Sum the scalar outputs (loss, accuracies) of one micro-batch into ``totals``."""
    for name, value in outputs.items():
        if value is not None and value.dim() == 0:
            value = value.detach().float()
            totals[name] = totals[name] + value if name in totals else value


def _cpu_copy(value: Any) -> Any:
    """``value`` with every tensor replaced by a CPU copy (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_cpu_copy(v) for v in value)
    return value


def _few(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "")

"""The numbers of a plan: what a run holds per device and pipeline stage, before it runs.

Everything is read from the annotated graph and the config, and bytes per parameter follow what
popbert's torch backend really allocates, so a plan can be checked against a measured step
(``benchmarks/plan_accuracy.py``). What is counted per parameter and per device, and the peak:
docs/design.md, section "popbert.plan.estimate".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx

from popbert.graph.annotations import (
    IPU_NUMBER,
    PIPELINE_STAGE,
    node_annotation,
    trainable_initializers,
)
from popbert.plan.activations import (
    ActivationModel,
    Precision,
    activation_model,
    peak_of_regions,
)
from popbert.plan.devices import Device
from popbert.plan.flops import BACKWARD_FACTOR, forward_flops_by_node
from popbert.plan.shapes import infer_tensor_shapes

if TYPE_CHECKING:
    from popbert.builders.bert_config import BertConfig
    from popbert.config import RunConfig

__all__ = ["CPU_TILE_NUMEL", "FAMILY_NOTES", "DevicePlan", "Plan", "StagePlan",
           "WORKSPACE_BYTES_PER_PARAM", "build_training_graph", "family_notes", "plan_run",
           "state_bytes_per_param"]

# popbert.optimizers.tiling.CPU_TILE_NUMEL (kept in step by tests/plan/test_plan.py; importing it
# here would make `popbert plan` pay for importing torch).
CPU_TILE_NUMEL = 1 << 21
# Optimizer-step workspace per parameter stepped at once, by weight width (measured with
# whole-tensor steps: benchmarks/plan_accuracy.py).
WORKSPACE_BYTES_PER_PARAM = {4: 4, 2: 15}
MOMENT_BYTES = 8  # FP32 m and v
FP32_VIEW_BYTES = 4  # the FP32 view of a half weight the torch backend computes from
_WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state on one replica."""

    weights: float
    gradients: float
    optimizer: float


def state_bytes_per_param(weight_dtype: str, replicas: int, sharded: bool) -> StateBytes:
    """Weights, gradients and optimizer state per parameter (see the module's table)."""
    w = _WIDTH[weight_dtype]
    if not sharded:
        return StateBytes(w, w, MOMENT_BYTES)
    scatter = w / replicas if replicas > 1 else 0.0
    return StateBytes(w, w + 4 / replicas + scatter, MOMENT_BYTES / replicas)


@dataclass
class StagePlan:
    """One ``(__ipu_number, __pipeline_stage)`` of the graph (or the totals: ipu/stage None)."""

    ipu: int | None
    stage: int | None
    parameters: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    gradient_bytes_rts: int  # with RTS over execution.replicas
    optimizer_bytes_rts: int
    activation_bytes: int  # peak of one micro-batch, no recomputation
    activation_bytes_recompute: int  # peak of one micro-batch with recomputation
    training_flops_per_sequence: int


@dataclass
class DevicePlan:
    """One device of one replica as the run places the graph, and its peak."""

    device: int  # the __ipu_number (0 when the run does not pipeline)
    stages: list[int]
    micro_batches_in_flight: dict[int, int]
    parameters: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # micro-batches in flight, recomputation as configured (peak)
    activation_kept_bytes: int  # the same without the backward pass's transient
    weight_view_bytes: int  # weight copies alive through forward and backward (torch)
    forward_view_bytes: int  # weight copies alive during the forward pass only (torch)
    workspace_bytes: int  # the optimizer step's transient
    total_bytes: int = 0

    @property
    def forward_backward_bytes(self) -> int:
        """Everything a micro-batch's forward and backward pass adds to the state at its peak:
        the end of the forward pass (its weight copies, half the backward transient: the loss's
        input copy) or the start of the backward pass (the whole transient)."""
        transient = self.activation_bytes - self.activation_kept_bytes
        return (self.activation_kept_bytes + self.weight_view_bytes
                + max(transient, self.forward_view_bytes + transient // 2))

    def __post_init__(self) -> None:
        self.total_bytes = (self.weight_bytes + self.gradient_bytes + self.optimizer_bytes
                            + max(self.forward_backward_bytes, self.workspace_bytes))


@dataclass
class Plan:
    """What a run needs, per stage and per device, and whether it fits ``target``."""

    config_name: str
    model: dict[str, int]
    execution: dict[str, object]
    stages: list[StagePlan]
    totals: StagePlan
    devices: list[DevicePlan]
    kind: str  # "ipu" | "gpu" | "cpu": what the activation and workspace numbers assume
    target: Device | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        """Whether every device fits the target's memory (None without a target)."""
        if self.target is None:
            return None
        return all(d.total_bytes <= self.target.memory_bytes for d in self.devices)


def build_training_graph(cfg: RunConfig) -> onnx.ModelProto:
    """The pre-training graph of ``cfg`` at its micro batch (zero weights: only shapes matter,
    and zeros skip drawing hundreds of millions of random numbers)."""
    from popbert.builders.bert import build_bert

    return build_bert(cfg.model, zeros=True,
                      batch_size=cfg.execution.micro_batch_size).model()


def _stages_and_ipus(model: onnx.ModelProto) -> tuple[list[int], list[int]]:
    """Each node's pipeline stage and device, by ``popbert.runtime.partition``'s rules: a
    node's annotation, else the latest stage of its inputs (0 without any); a stage's device is
    the ``__ipu_number`` of its annotated nodes (0 without any)."""
    stage_of_tensor: dict[str, int] = {}
    stages, ipu_annotations = [], []
    for node in model.graph.node:
        annotated = node_annotation(node, PIPELINE_STAGE)
        inputs = [stage_of_tensor[i] for i in node.input if i in stage_of_tensor]
        stage = int(annotated) if annotated is not None else max(inputs, default=0)
        for out in node.output:
            stage_of_tensor[out] = stage
        stages.append(stage)
        ipu_annotations.append(node_annotation(node, IPU_NUMBER))
    ipu_of_stage: dict[int, int] = {}
    for stage, ipu in zip(stages, ipu_annotations):
        if ipu is not None:
            ipu_of_stage.setdefault(stage, int(ipu))
    return stages, [ipu_of_stage.get(s, 0) for s in stages]


def _in_flight(schedule: str, position: int, num_stages: int, accumulation: int) -> int:
    """Micro-batches whose activations a stage holds at once (runtime.schedules)."""
    if schedule == "gpipe":
        return accumulation
    return min(num_stages - position, accumulation)


def _kind(cfg: RunConfig, target: Device | None) -> str:
    """What the target runs like: its own kind, else the config's device (cpu, else GPU)."""
    if target is not None and target.kind:
        return target.kind
    return "cpu" if cfg.execution.device == "cpu" else "gpu"


def plan_run(cfg: RunConfig, target: Device | None = None,
             model: onnx.ModelProto | None = None, config_name: str = "") -> Plan:
    """The plan of ``cfg``'s pre-training run, checked against ``target`` when given.

    ``model``: the pre-training graph when the caller has it (else built from ``cfg.model``
    at ``execution.micro_batch_size``; its batch must be that micro batch).
    """
    e = cfg.execution
    if model is None:
        model = build_training_graph(cfg)
    kind = _kind(cfg, target)
    if target is not None and not target.kind:
        target = dataclasses.replace(target, kind=kind)
    width = _WIDTH[e.compute_dtype]
    autocast = None
    if width < 4 and kind != "ipu":  # the torch backend runs half compute under autocast
        autocast = "cpu" if kind == "cpu" else "cuda"
    precision = Precision(width, autocast, dropout_mask=None if kind == "cpu" else 1)
    batch = e.micro_batch_size
    shapes = infer_tensor_shapes(model, batch)
    flops = forward_flops_by_node(model, shapes)
    stage_of, ipu_of = _stages_and_ipus(model)
    key_of = list(zip(ipu_of, stage_of))
    keys = sorted(set(key_of), key=lambda k: (k[1], k[0]))

    # Parameters: each weight belongs to the first node that reads it.
    inits = {t.name: t for t in model.graph.initializer}
    trainable = trainable_initializers(model)
    first_reader: dict[str, tuple[int, int]] = {}
    for node, key in zip(model.graph.node, key_of):
        for name in node.input:
            first_reader.setdefault(name, key)
    params: dict[tuple[int, int], int] = {k: 0 for k in keys}
    largest: dict[tuple[int, int], int] = {}
    cast: dict[tuple[int, int], int] = {}  # autocast's half copies of matmul weights
    matmul_weights = _matmul_weights(model)
    for name in trainable:
        key = first_reader.get(name, keys[0] if keys else (0, 0))
        numel = int(np.prod(inits[name].dims, dtype=np.int64))
        params[key] = params.get(key, 0) + numel
        largest[key] = max(largest.get(key, 0), numel)
        if autocast is not None and name in matmul_weights:
            cast[key] = cast.get(key, 0) + numel
    if not keys:
        keys = sorted(params)

    plain = state_bytes_per_param(e.weight_dtype, e.replicas, sharded=False)
    rts = state_bytes_per_param(e.weight_dtype, e.replicas, sharded=True)
    per_stage = activation_model(model, shapes, stage_of, precision)
    stages = []
    for ipu, stage in keys:
        n = params.get((ipu, stage), 0)
        regions = [r for r in per_stage.regions if r.stage == stage]
        stages.append(StagePlan(
            ipu, stage, n, _bytes(n, plain.weights), _bytes(n, plain.gradients),
            _bytes(n, plain.optimizer), _bytes(n, rts.gradients), _bytes(n, rts.optimizer),
            peak_of_regions(per_stage, regions, recompute=False).peak,
            peak_of_regions(per_stage, regions, recompute=True).peak,
            BACKWARD_FACTOR * sum(f for f, k in zip(flops, key_of) if k == (ipu, stage))
            // batch))
    total_params = sum(params.values())
    whole = activation_model(model, shapes, [0] * len(stage_of), precision)
    totals = StagePlan(
        None, None, total_params, sum(s.weight_bytes for s in stages),
        sum(s.gradient_bytes for s in stages), sum(s.optimizer_bytes for s in stages),
        sum(s.gradient_bytes_rts for s in stages), sum(s.optimizer_bytes_rts for s in stages),
        peak_of_regions(whole, whole.regions, recompute=False).peak,
        peak_of_regions(whole, whole.regions, recompute=True).peak,
        sum(s.training_flops_per_sequence for s in stages))

    notes: list[str] = []
    checkpoints = len(whole.regions) - 1
    if e.recompute and checkpoints == 0:
        notes.append("execution.recompute is on but the graph has no checkpoints (set "
                     "model.recompute=true with model.layers_per_ipu): the run would refuse it")
    devices = _devices(cfg, kind, stages, per_stage, whole, largest, cast, width)
    if kind == "ipu" and not e.pipeline and len({k[0] for k in keys}) > 1:
        notes.append("execution.pipeline is off: the whole graph is planned on one device; "
                     "set execution.pipeline=true to place each __ipu_number on its own IPU")
    if e.weight_dtype != "float32" and kind != "ipu":
        notes.append("activations include the FP32 views of the half weights the torch backend "
                     "computes from (4 bytes/parameter)")
    if autocast == "cuda":
        notes.append(f"{e.compute_dtype} compute runs under torch's CUDA autocast: its FP32 ops "
                     "(LayerNorm, softmax, the loss) are modelled from torch's op lists; the "
                     "CPU model was measured (benchmarks/plan_accuracy.py), the CUDA one not yet")
    notes += family_notes(cfg.model)
    model_info = {"architecture": cfg.model.architecture, "layers": cfg.model.num_layers,
                  "hidden": cfg.model.hidden_size,
                  "heads": cfg.model.num_heads, "intermediate": cfg.model.intermediate_size,
                  "vocab": cfg.model.vocab_size, "sequence_length": cfg.model.sequence_length,
                  "max_predictions_per_seq": cfg.model.max_predictions_per_seq,
                  "checkpoints": checkpoints}
    execution = {"micro_batch_size": batch, "replicas": e.replicas,
                 "gradient_accumulation": e.gradient_accumulation,
                 "replicated_tensor_sharding": e.replicated_tensor_sharding,
                 "pipeline": e.pipeline, "pipeline_schedule": e.pipeline_schedule,
                 "recompute": e.recompute, "weight_dtype": e.weight_dtype,
                 "compute_dtype": e.compute_dtype}
    return Plan(config_name, model_info, execution, stages, totals, devices, kind, target, notes)


def _modernbert_notes(m: BertConfig) -> list[str]:
    """The sliding window: popbert computes it as full attention under a band mask."""
    from popbert.builders.modernbert import is_global

    local = sum(1 for i in range(m.num_layers) if not is_global(m, i))
    if not local:
        return []
    s, half = m.sequence_length, m.modernbert.local_attention // 2
    # Keys a query sees, summed over the queries: |i - j| <= half, clipped to the row.
    seen = sum(min(i + half, s - 1) - max(i - half, 0) + 1 for i in range(s))
    attention = BACKWARD_FACTOR * 2 * s * s * 2 * m.hidden_size * local  # score + context
    return [f"sliding-window attention: {local} of {m.num_layers} layers attend within "
            f"{half} tokens each side, but the graph computes their full {s} x {s} scores under "
            f"a band mask, so their FLOPs and activations are counted as full attention's "
            f"({_flop_text(attention)}/seq of score and context matmuls; a kernel that "
            f"skipped masked keys would do {seen / (s * s):.0%} of them)"]


def _flop_text(flops: int) -> str:
    return f"{flops / 1e9:.2f} GFLOP" if flops >= 10**8 else f"{flops / 1e6:.2f} MFLOP"


# What a plan says about how a family is counted, by `model.architecture` (none for the rest).
FAMILY_NOTES: dict[str, Callable[[BertConfig], list[str]]] = {
    "modernbert": _modernbert_notes,
}


def family_notes(model: BertConfig) -> list[str]:
    """The notes of ``model.architecture``'s family (:data:`FAMILY_NOTES`)."""
    notes = FAMILY_NOTES.get(model.architecture)
    return [] if notes is None else notes(model)


def _bytes(numel: int, per_param: float) -> int:
    return int(math.ceil(numel * per_param))


def _matmul_weights(model: onnx.ModelProto) -> set[str]:
    """Weights a MatMul/Gemm reads, directly or through views (the tied projection's
    Transpose): autocast keeps a half copy of each through the backward pass."""
    view_of = {}
    for node in model.graph.node:
        if node.op_type in ("Transpose", "Reshape", "Identity") and node.input:
            view_of[node.output[0]] = view_of.get(node.input[0], node.input[0])
    return {view_of.get(i, i) for node in model.graph.node if node.op_type in ("MatMul", "Gemm")
            for i in node.input}


def _devices(cfg: RunConfig, kind: str, stages: list[StagePlan], per_stage: ActivationModel,
             whole: ActivationModel, largest: dict[tuple[int, int], int],
             cast: dict[tuple[int, int], int], compute_width: int) -> list[DevicePlan]:
    """The devices of one replica: one per ``__ipu_number`` when pipelining, else one."""
    e = cfg.execution
    state = state_bytes_per_param(e.weight_dtype, e.replicas, e.replicated_tensor_sharding)
    width = _WIDTH[e.weight_dtype]
    views = FP32_VIEW_BYTES if width == 2 and kind != "ipu" else 0
    groups: dict[int, list[StagePlan]] = {}
    for s in stages:
        groups.setdefault(s.ipu if e.pipeline else 0, []).append(s)
    order = sorted({s.stage for s in stages})
    devices = []
    for device, members in sorted(groups.items()):
        n = sum(s.parameters for s in members)
        in_flight: dict[int, int] = {}
        if e.pipeline:
            kept_total, extra = 0, 0
            for s in members:
                regions = [r for r in per_stage.regions if r.stage == s.stage]
                act = peak_of_regions(per_stage, regions, recompute=e.recompute)
                flight = _in_flight(e.pipeline_schedule, order.index(s.stage), len(order),
                                    e.gradient_accumulation)
                in_flight[s.stage] = flight
                kept_total += flight * act.kept
                extra = max(extra, act.peak - act.kept)
            activations, kept = kept_total + extra, kept_total
        else:
            act = peak_of_regions(whole, whole.regions, recompute=e.recompute)
            activations, kept = act.peak, act.kept
            in_flight = {s.stage: 1 for s in members}
        biggest = max((largest.get((s.ipu, s.stage), 0) for s in members), default=0)
        shards = e.replicas if e.replicated_tensor_sharding else 1
        if kind == "ipu":
            stepped = math.ceil(biggest / shards)  # PopART: one update op per weight
        elif e.replicated_tensor_sharding:
            stepped = math.ceil(n / shards)  # a shard's updates wait for LAMB's norms
        elif kind == "cpu":
            stepped = min(n, CPU_TILE_NUMEL + biggest)
        else:
            stepped = n  # whole-tensor steps
        workspace = stepped * WORKSPACE_BYTES_PER_PARAM[width]
        # Half weights are read through FP32 views: kept for the backward pass by FP32 matmuls;
        # under autocast the matmuls keep half copies instead and the views die with the
        # forward pass. Autocast also keeps half copies of FP32 matmul weights.
        copies = compute_width * sum(cast.get((s.ipu, s.stage), 0) for s in members)
        autocast = compute_width < 4 and kind != "ipu"
        always, forward_only = (copies, n * views) if autocast else (n * views, 0)
        devices.append(DevicePlan(
            device, [s.stage for s in members], in_flight, n, _bytes(n, state.weights),
            _bytes(n, state.gradients), _bytes(n, state.optimizer), activations, kept, always,
            forward_only, workspace))
    return devices

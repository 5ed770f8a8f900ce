"""Pipelining and recomputation, part one: the lowered graph split at its annotations.

:class:`Program` splits the lowered ``fx`` graph into partitions keyed by (pipeline stage,
recompute region) and runs a micro-batch stage by stage; the schedule that orders them is
:mod:`popbert.runtime.schedules`. How stages and regions are read from the annotations, and how
a cut stage hands gradients back: docs/design.md, section "popbert.runtime.partition".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.fx.passes.split_module import split_module

from popbert.graph.annotations import IPU_NUMBER, PIPELINE_STAGE, annotation, is_checkpoint

log = logging.getLogger(__name__)

_REGIONS = 100_000  # partition key = stage * _REGIONS + region

__all__ = ["MicroBatch", "Partition", "Program"]


@dataclass
class Partition:
    """One (stage, region) piece of the graph, a GraphModule of its own."""

    name: str
    module: torch.nn.Module
    stage: int
    region: int
    recompute: bool = False


@dataclass
class MicroBatch:
    """Values of one micro-batch flowing through the program (``cut``: stage by stage, each
    stage its own autograd graph)."""

    inputs: dict[str, torch.Tensor]
    cut: bool
    env: dict[fx.Node, Any] = field(default_factory=dict)
    # (consumer stage, producer node) -> detached leaf standing for the producer's value
    leaves: dict[tuple[int, fx.Node], Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    seed: torch.Tensor | None = None  # the scaled loss this micro-batch's backward starts from
    seed_stage: int = -1  # the stage that computed it


class Program:
    """The lowered graph as partitions by (pipeline stage, recompute region).

    ``device_of_ipu`` maps an ``__ipu_number`` to a torch device (pipelining); without pipelining
    everything runs on ``device``. ``cast_params``: parameters are read as FP32 views (FP16/BF16
    weights; gradients flow back into the half-precision tensors).
    """

    def __init__(self, module: fx.GraphModule, *, pipeline: bool, recompute: bool,
                 device: torch.device, device_of_ipu: Callable[[int], torch.device] | None = None,
                 cast_params: bool = False, compile: bool = False):
        self.module = module
        self.cast_params = cast_params
        graph_nodes = [n for n in module.graph.nodes if n.op not in ("placeholder", "output")]
        stage_of = _assign_stages(graph_nodes, pipeline)
        ipu_of_stage = _ipus(graph_nodes, stage_of) if pipeline else {}
        region_of = _assign_regions(graph_nodes, stage_of) if recompute else {}
        keys = {n: stage_of[n] * _REGIONS + region_of.get(n, 0) for n in graph_nodes}
        split = split_module(module, module, lambda n: keys[n])
        self.split = split

        stages_used = sorted({k // _REGIONS for k in keys.values()})
        self.stages: list[int] = stages_used
        self.stage_device: dict[int, torch.device] = {}
        for stage in stages_used:
            if pipeline and device_of_ipu is not None:
                self.stage_device[stage] = torch.device(device_of_ipu(ipu_of_stage.get(stage, 0)))
            else:
                self.stage_device[stage] = torch.device(device)
        self.ipu_of_stage = {s: ipu_of_stage.get(s, 0) for s in stages_used}

        self.partitions: dict[str, Partition] = {}
        final_key = max(keys.values())
        for node in split.graph.nodes:
            if node.op != "call_module":
                continue
            key = int(str(node.target).rsplit("_", 1)[1])
            stage, region = divmod(key, _REGIONS)
            sub = getattr(split, node.target)
            if compile:
                sub = torch.compile(sub)
            self.partitions[node.target] = Partition(node.target, sub, stage, region,
                                                     recompute=recompute and key != final_key)
        if recompute and not any(p.recompute for p in self.partitions.values()):
            raise ValueError("recomputation needs checkpoint annotations "
                             "(`__recompute_output_in_backward_pass`) in the graph, or "
                             "pipelining; this graph has one region and nothing to recompute")

        # Top-level nodes by stage; get_attr and placeholders are read by whichever stage uses
        # them (a weight read by two stages, like the tied embedding, is read by both).
        self.placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in split.graph.nodes if n.op == "output")
        self.node_stage: dict[fx.Node, int] = {}
        for node in split.graph.nodes:
            if node.op == "call_module":
                self.node_stage[node] = self.partitions[node.target].stage
            elif node.op == "call_function":
                sources = [self.node_stage[a] for a in node.all_input_nodes
                           if a in self.node_stage]
                self.node_stage[node] = max(sources, default=stages_used[0])
        self.stage_nodes: dict[int, list[fx.Node]] = {s: [] for s in stages_used}
        for node, stage in self.node_stage.items():
            self.stage_nodes[stage].append(node)
        order = {n: i for i, n in enumerate(split.graph.nodes)}
        for nodes in self.stage_nodes.values():
            nodes.sort(key=order.__getitem__)

        # Boundaries: which values each stage hands to later stages.
        self.producers: dict[int, set[int]] = {s: set() for s in stages_used}
        self.consumers: dict[int, set[int]] = {s: set() for s in stages_used}
        self.boundary: dict[int, list[tuple[fx.Node, list[int]]]] = {s: [] for s in stages_used}
        for node, stage in self.node_stage.items():
            users = sorted({self.node_stage[u] for u in node.users
                            if u in self.node_stage and self.node_stage[u] != stage})
            for user_stage in users:
                if user_stage < stage:
                    raise ValueError(f"stage {user_stage} reads {node.name} of later stage {stage}")
                self.producers[user_stage].add(stage)
                self.consumers[stage].add(user_stage)
            if users:
                self.boundary[stage].append((node, users))
        self.output_args: list[Any] = list(self.output_node.args[0])
        self.param_devices = self._place_parameters()
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        log.debug("program: stages %s on %s, %d partitions (%d recomputed)", stages_used,
                  {s: str(d) for s, d in self.stage_device.items()}, len(self.partitions),
                  sum(p.recompute for p in self.partitions.values()))

    # -- placement -----------------------------------------------------------------------------
    def _users_stages(self, node: fx.Node) -> set[int]:
        return {self.node_stage[u] for u in node.users if u in self.node_stage}

    def _place_parameters(self) -> dict[str, torch.device]:
        """The device of each parameter: that of the stage(s) reading it, which must agree."""
        params = dict(self.module.named_parameters())
        devices: dict[str, torch.device] = {}
        for node in self.split.graph.nodes:
            if node.op != "get_attr" or node.target not in params:
                continue
            for stage in self._users_stages(node):
                device = self.stage_device[stage]
                known = devices.setdefault(node.target, device)
                if known != device:
                    raise ValueError(
                        f"weight {node.target!r} is read by stages on {known} and {device}: a "
                        "weight shared by several stages (the tied embedding) must have all of "
                        "them on one device")
        return devices

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of_output(self, index: int) -> int:
        arg = self.output_args[index]
        if isinstance(arg, fx.Node) and arg in self.node_stage:
            return self.node_stage[arg]
        return self.stages[-1]

    # -- evaluation ----------------------------------------------------------------------------
    def _attr(self, target: str, device: torch.device) -> Any:
        value = self.module
        for part in target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.nn.Parameter):
            return value.float() if self.cast_params and value.is_floating_point() else value
        if isinstance(value, torch.Tensor) and value.device != device:
            key = (target, str(device))
            cached = self._buffers.get(key)
            if cached is None:
                cached = self._buffers[key] = value.to(device)
            return cached
        return value

    def _value(self, mb: MicroBatch, node: fx.Node, stage: int) -> Any:
        device = self.stage_device[stage]
        if node.op == "placeholder":
            return mb.inputs[node.target].to(device, non_blocking=True)
        if node.op == "get_attr":
            return self._attr(node.target, device)
        value = mb.env[node]
        if self.node_stage[node] == stage:
            return value
        key = (stage, node)
        if key in mb.leaves:
            return mb.leaves[key]
        if isinstance(value, torch.Tensor):
            moved = value.to(device, non_blocking=True)
            if mb.cut:
                moved = moved.detach()
                if value.requires_grad:
                    moved.requires_grad_(True)
            value = moved
        mb.leaves[key] = value
        return value

    def forward_stage(self, mb: MicroBatch, stage: int) -> list[int]:
        """Run one stage of one micro-batch (its partitions and the tuple unpacking); returns
        the indices of the graph outputs it computed."""
        for node in self.stage_nodes[stage]:
            args = fx.node.map_arg(node.args, lambda n: self._value(mb, n, stage))
            kwargs = fx.node.map_arg(node.kwargs, lambda n: self._value(mb, n, stage))
            if node.op == "call_module":
                part = self.partitions[node.target]
                if part.recompute and torch.is_grad_enabled():
                    mb.env[node] = torch.utils.checkpoint.checkpoint(
                        part.module, *args, use_reentrant=False, **kwargs)
                else:
                    mb.env[node] = part.module(*args, **kwargs)
            else:
                mb.env[node] = node.target(*args, **kwargs)
        produced = []
        for index, arg in enumerate(self.output_args):
            if isinstance(arg, fx.Node) and self.node_stage.get(arg) == stage:
                mb.outputs[index] = mb.env[arg]
                produced.append(index)
        return produced

    def finish_outputs(self, mb: MicroBatch) -> tuple[Any, ...]:
        """The micro-batch's graph outputs in order, fetching those no stage produced itself
        (graph inputs or weights passed straight through) from the last stage."""
        last = self.stages[-1]
        for index, arg in enumerate(self.output_args):
            if index not in mb.outputs:
                mb.outputs[index] = (self._value(mb, arg, last) if isinstance(arg, fx.Node)
                                     else arg)
        return tuple(mb.outputs[i] for i in range(len(self.output_args)))

    def micro_batch(self, inputs: Sequence[torch.Tensor], cut: bool) -> MicroBatch:
        names = [n.target for n in self.placeholders]
        if len(inputs) != len(names):
            raise ValueError(f"the graph takes {len(names)} inputs, got {len(inputs)}")
        return MicroBatch(dict(zip(names, inputs)), cut)

    def __call__(self, *inputs: torch.Tensor) -> tuple[Any, ...]:
        """The whole graph as one autograd graph (inference, or a plain backward pass)."""
        mb = self.micro_batch(inputs, cut=False)
        for stage in self.stages:
            self.forward_stage(mb, stage)
        return self.finish_outputs(mb)

    def backward_stage(self, mb: MicroBatch, stage: int) -> None:
        """Backward of one stage: its boundary values' gradients (from the consumer stages'
        leaves) and, in the loss stage, the scaled loss."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for node, users in self.boundary[stage]:
            value = mb.env.get(node)
            if not isinstance(value, torch.Tensor) or not value.requires_grad:
                continue
            grad = None
            for user in users:
                leaf = mb.leaves.pop((user, node), None)
                if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
                    g = leaf.grad.to(value.device, non_blocking=True)
                    grad = g if grad is None else grad + g
            if grad is not None:
                tensors.append(value)
                grads.append(grad)
        if mb.seed is not None and mb.seed_stage == stage:
            tensors.append(mb.seed)
            grads.append(None)
            mb.seed = None
        if tensors:
            torch.autograd.backward(tensors, grads)
        for node in self.stage_nodes[stage]:  # free this stage's activations
            mb.env.pop(node, None)


# ---------------------------------------------------------------------------------------------
# Annotation analysis
# ---------------------------------------------------------------------------------------------


def _onnx_name(node: fx.Node) -> str:
    meta = node.meta.get("onnx") or {}
    return meta.get("name") or node.name


def _assign_stages(nodes: Sequence[fx.Node], pipeline: bool) -> dict[fx.Node, int]:
    """Stage of every node: its annotation, else the latest stage of its inputs (or 0)."""
    stage_of: dict[fx.Node, int] = {}
    annotated = False
    for node in nodes:
        inputs = [stage_of[a] for a in node.all_input_nodes if a in stage_of]
        stage = annotation(node, PIPELINE_STAGE) if pipeline else 0
        if stage is None:
            stage = max(inputs, default=0)
        else:
            annotated = True
            stage = int(stage)
            if inputs and stage < max(inputs):
                raise ValueError(f"ONNX node {_onnx_name(node)!r} is in pipeline stage {stage} "
                                 f"but reads a value of stage {max(inputs)}: stages must not "
                                 "go backwards")
        stage_of[node] = stage
    if pipeline and not annotated:
        raise ValueError("pipelining needs `__pipeline_stage` annotations in the graph "
                         "(build it with model.layers_per_ipu)")
    return stage_of


def _ipus(nodes: Sequence[fx.Node], stage_of: dict[fx.Node, int]) -> dict[int, int]:
    """The ``__ipu_number`` of each stage; a stage spanning two devices is an error."""
    found: dict[int, set[int]] = {}
    for node in nodes:
        ipu = annotation(node, IPU_NUMBER)
        if ipu is not None:
            found.setdefault(stage_of[node], set()).add(int(ipu))
    ipus = {}
    for stage, values in found.items():
        if len(values) > 1:
            raise ValueError(f"pipeline stage {stage} spans devices {sorted(values)}: each stage "
                             "must sit on one `__ipu_number`")
        ipus[stage] = values.pop()
    return ipus


def _assign_regions(nodes: Sequence[fx.Node], stage_of: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Recompute region of every node: checkpoints close a region within their stage."""
    counter: dict[int, int] = {}
    region_of: dict[fx.Node, int] = {}
    for node in nodes:
        stage = stage_of[node]
        region_of[node] = counter.get(stage, 0)
        if is_checkpoint(node):
            counter[stage] = region_of[node] + 1
    return region_of

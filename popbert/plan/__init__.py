"""`popbert plan`: what a run needs per device and pipeline stage, without running it.

Graphcore's compile-only check told, before a pre-training run, whether each IPU's memory held
its share; this package does the same for any device from the annotated graph and the config
alone: parameters, weights, gradients and optimizer state (with and without replicated tensor
sharding), activations per micro-batch (with and without recomputation), the training FLOPs per
sequence, and a verdict against a device's memory. It sits above ``popbert.config``,
``popbert.builders`` and ``popbert.graph`` and nothing below imports it; it never imports torch,
so a plan of BERT-Large takes seconds.

``training_flops_per_sequence(model)`` is the FLOP count benchmarks compute MFU from.
"""

from popbert.plan.devices import DEVICES, Device, custom_device, device_named
from popbert.plan.estimate import (
    DevicePlan,
    Plan,
    StagePlan,
    build_training_graph,
    plan_run,
    state_bytes_per_param,
)
from popbert.plan.flops import forward_flops_by_node, training_flops_per_sequence
from popbert.plan.report import format_bytes, plan_dict, plan_table

__all__ = ["DEVICES", "Device", "DevicePlan", "Plan", "StagePlan", "build_training_graph",
           "custom_device", "device_named", "format_bytes", "forward_flops_by_node",
           "plan_dict", "plan_run", "plan_table", "state_bytes_per_param",
           "training_flops_per_sequence"]

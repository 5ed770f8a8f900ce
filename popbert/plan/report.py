"""A plan as people read it (a table) and as programs read it (one JSON document).

The table is what a compile-only check on Graphcore's SDK gave: one row per device and pipeline
stage, the totals, then one FITS / DOES NOT FIT line per device of the run with the margin.
Units are decimal (1 MB = 10⁶ bytes), like the device capacities they are compared with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from popbert.builders.families import FAMILIES
from popbert.plan.estimate import DevicePlan, Plan, StagePlan

__all__ = ["format_bytes", "plan_dict", "plan_table"]

CONVENTIONS = {
    "flops": "training FLOPs per sequence = 3 x forward matmul FLOPs; a matmul is 2*M*N*K, "
             "attention score and context matmuls included (at the full S x S the graph "
             "computes, a sliding window's mask included), other ops not counted",
    "bytes": "decimal units; per replica; weights/gradients in the weight dtype, optimizer "
             "state FP32 m and v (8 bytes/parameter, 8/N with RTS over N replicas)",
    "activations": "peak of one micro-batch's forward and backward pass: tensors autograd "
                   "keeps, graph inputs and outputs, plus two of the largest activation "
                   "(gradients in flight); with recompute only region inputs plus one region",
}


def format_bytes(n: float) -> str:
    """``n`` bytes in MB below 1 GB, else in GB (decimal)."""
    if abs(n) < 10**9:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e9:.2f} GB"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def _header(plan: Plan) -> list[str]:
    m, e = plan.model, plan.execution
    name = f"{plan.config_name}: " if plan.config_name else ""
    architecture = str(m.get("architecture", "bert"))
    known = FAMILIES.get(architecture)
    family = known.title if known is not None else architecture
    rts = f"RTS over {e['replicas']}" if e["replicated_tensor_sharding"] else "RTS off"
    pipeline = f"pipeline {e['pipeline_schedule']}" if e["pipeline"] else "pipeline off"
    return [
        f"popbert plan - {name}{family} L{m['layers']} H{m['hidden']} A{m['heads']} "
        f"I{m['intermediate']} V{m['vocab']}, sequence {m['sequence_length']}, "
        f"{m['max_predictions_per_seq']} MLM positions, {m['checkpoints']} recompute checkpoints",
        f"micro batch {e['micro_batch_size']} x accumulation {e['gradient_accumulation']} x "
        f"replicas {e['replicas']}; weights {e['weight_dtype']}, compute {e['compute_dtype']}; "
        f"{pipeline}, recompute {'on' if e['recompute'] else 'off'}, {rts}",
        f"training FLOPs per sequence: {plan.totals.training_flops_per_sequence / 1e9:.2f} GFLOP "
        "(3 x forward matmuls at 2*M*N*K, attention matmuls and convolutions included)",
    ]


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return lines


def _stage_row(s: StagePlan) -> list[str]:
    return [
        "total" if s.ipu is None else str(s.ipu), "" if s.stage is None else str(s.stage),
        _count(s.parameters), format_bytes(s.weight_bytes), format_bytes(s.gradient_bytes),
        format_bytes(s.optimizer_bytes), format_bytes(s.gradient_bytes_rts),
        format_bytes(s.optimizer_bytes_rts), format_bytes(s.activation_bytes),
        format_bytes(s.activation_bytes_recompute), f"{s.training_flops_per_sequence / 1e9:.2f}",
    ]


def _device_row(d: DevicePlan) -> list[str]:
    flight = ",".join(f"{d.micro_batches_in_flight[s]}" for s in d.stages)
    return [str(d.device), ",".join(map(str, d.stages)), flight, _count(d.parameters),
            format_bytes(d.weight_bytes), format_bytes(d.gradient_bytes),
            format_bytes(d.optimizer_bytes),
            format_bytes(d.forward_backward_bytes),
            format_bytes(d.workspace_bytes), format_bytes(d.total_bytes)]


def plan_table(plan: Plan) -> str:
    """The plan as a text table (one row per device and stage, totals, a verdict per device)."""
    replicas = plan.execution["replicas"]
    lines = _header(plan) + [""]
    lines += _table(
        ["IPU", "stage", "params", "weights", "grads", "optimizer", f"grads RTS/{replicas}",
         f"optim RTS/{replicas}", "act/micro-batch", "act recompute", "GFLOP/seq"],
        [_stage_row(s) for s in [*plan.stages, plan.totals]])
    lines += ["(a stage's act/micro-batch is its own peak; the total row's is the whole graph's "
              "on one device)", ""]
    e = plan.execution
    placed = ("each __ipu_number on its own device" if e["pipeline"]
              else "the whole graph on one device")
    lines.append(f"one replica as configured ({placed}; activations for the {plan.kind}):")
    lines += _table(["device", "stages", "in flight", "params", "weights", "grads", "optimizer",
                     "activations", "opt. step", "peak"],
                    [_device_row(d) for d in plan.devices])
    target = plan.target
    if target is None:
        lines.append("no device named: give --device "
                     "(ipu-mk2, h100, a100-40gb, a100-80gb) or --memory-gb for a verdict")
    else:
        lines.append(f"{target.name}: {target.description}, "
                     f"{format_bytes(target.memory_bytes)} per device")
        for d in plan.devices:
            margin = target.memory_bytes - d.total_bytes
            share = abs(margin) / target.memory_bytes
            if margin >= 0:
                verdict = f"FITS, margin {format_bytes(margin)} ({share:.0%} free)"
            else:
                verdict = f"DOES NOT FIT, short by {format_bytes(-margin)} ({share:.0%} over)"
            lines.append(f"device {d.device}: needs {format_bytes(d.total_bytes)} of "
                         f"{format_bytes(target.memory_bytes)}: {verdict}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON-ready data: every number of the table, in bytes and FLOPs."""
    target = plan.target
    devices = []
    for d in plan.devices:
        entry = dataclasses.asdict(d)
        entry["micro_batches_in_flight"] = {str(k): v for k, v in d.micro_batches_in_flight.items()}
        if target is not None:
            entry["fits"] = d.total_bytes <= target.memory_bytes
            entry["margin_bytes"] = target.memory_bytes - d.total_bytes
        devices.append(entry)
    return {
        "config": plan.config_name,
        "model": plan.model,
        "execution": plan.execution,
        "assumes": plan.kind,
        "training_flops_per_sequence": plan.totals.training_flops_per_sequence,
        "stages": [dataclasses.asdict(s) for s in plan.stages],
        "totals": dataclasses.asdict(plan.totals),
        "devices": devices,
        "target": None if target is None else dataclasses.asdict(target),
        "fits": plan.fits,
        "notes": list(plan.notes),
        "conventions": CONVENTIONS,
    }

"""A micro-batch larger than memory holds, for a loss that couples its rows (in-batch negatives):
gradient caching (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"; sentence-transformers' `CachedMultipleNegativesRankingLoss`).

The training graph is cut at its `embedding` output (one vector per text; `popbert.tasks.
embedding`). Its part after the cut, the loss, is lowered on its own. A step then runs the
micro-batch in chunks of `rows` training rows:

1. each chunk through the graph without gradients, keeping only its vectors (and its random
   state, so dropout draws the same masks again in 3);
2. the loss over all the vectors at once, and its gradient with respect to them;
3. each chunk again with gradients, back-propagating that chunk's share of the vectors'
   gradient into the weights.

Only one chunk's activations are alive at a time; the gradients equal one pass over the whole
micro-batch (the same loss over the same vectors: without dropout to float rounding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import onnx
import torch
from onnx import helper

if TYPE_CHECKING:
    from popbert.runtime.session import TrainingSession

CUT = "embedding"  # the output the graph is cut at: [texts, hidden]

__all__ = ["CUT", "GradientCache", "loss_part"]


def loss_part(model: onnx.ModelProto, cut: str = CUT) -> tuple[onnx.ModelProto, list[str]]:
    """The graph after `cut`: the nodes its other outputs need that do not run before the cut,
    as a model whose inputs are the cut tensor and the graph inputs those nodes read (labels).
    Returns it and its inputs' names (the cut first)."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    if cut not in producer or producer[cut].op_type != "Identity":
        raise ValueError(f"gradient caching cuts the graph at its output {cut!r}, which this "
                         f"graph lacks (outputs: {', '.join(o.name for o in graph.output)})")
    vectors = producer[cut].input[0]  # the tensor the loss reads (the output is its Identity)
    graph_inputs = {i.name for i in graph.input}
    needed: set[int] = set()
    reads: set[str] = set()
    stack = [o.name for o in graph.output if o.name != cut]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name == vectors:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            if name in graph_inputs:
                reads.add(name)
            continue
        needed.add(id(node))
        stack.extend(i for i in node.input if i)
    nodes = [n for n in graph.node if id(n) in needed]
    used = {i for n in nodes for i in n.input}
    initializers = [t for t in graph.initializer if t.name in used]
    declared = {v.name: v for v in (*graph.value_info, *graph.output)}
    width = [d for d in declared[cut].type.tensor_type.shape.dim][-1].dim_value
    inputs = [helper.make_tensor_value_info(vectors, onnx.TensorProto.FLOAT, ["texts", width])]
    inputs += [i for i in graph.input if i.name in reads]
    outputs = [o for o in graph.output if o.name != cut]
    part = helper.make_graph(nodes, f"{graph.name}_after_{cut}", inputs, outputs,
                             initializers, value_info=[v for v in graph.value_info
                                                       if v.name in used])
    loss = helper.make_model(part, opset_imports=list(model.opset_import),
                             ir_version=model.ir_version)
    return loss, [i.name for i in inputs]


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None],
                   device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class GradientCache:
    """The three passes of a cached step for one session (see the module's docstring)."""

    def __init__(self, session: TrainingSession, rows: int):
        from popbert.lowering import lower_to_fx

        self.session, self.rows = session, rows
        proto, self.loss_inputs = loss_part(session.proto)
        self.loss_module = lower_to_fx(proto, trainable=False).to(session.device)
        self.loss_outputs = list(self.loss_module.output_names)

    def step(self, micro: Mapping[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
        """Back-propagate `weight` x the graph's loss on `micro` into the weights' gradients,
        `rows` training rows at a time; returns the loss part's outputs."""
        session = self.session
        total = len(next(iter(micro.values())))
        chunks = [slice(start, min(start + self.rows, total))
                  for start in range(0, total, self.rows)]
        states, vectors = [], []
        with torch.no_grad():
            for chunk in chunks:
                states.append(_rng_state(session.device))
                vectors.append(session.forward({k: v[chunk] for k, v in micro.items()})[CUT])
        cached = torch.cat(vectors).detach().requires_grad_(True)
        feeds = [cached] + [torch.as_tensor(micro[name]).to(session.device)
                            for name in self.loss_inputs[1:]]
        with session._autocast():
            outputs = dict(zip(self.loss_outputs, self.loss_module(*feeds)))
        (outputs[session.loss_name].float() * weight).backward()
        grad = cached.grad
        after = _rng_state(session.device)
        start = 0
        for chunk, state, part in zip(chunks, states, vectors):
            _set_rng_state(state, session.device)
            again = session.forward({k: v[chunk] for k, v in micro.items()})[CUT]
            torch.autograd.backward(again, grad[start:start + len(part)])
            start += len(part)
        _set_rng_state(after, session.device)
        return {k: v.detach() for k, v in outputs.items()}

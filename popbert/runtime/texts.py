"""Rows of several texts (an embedding model's anchor, positive and negatives), run text by
text: each text of a row trimmed to its own longest, and, in the cached mode, a micro-batch
larger than memory holds.

An embedding training graph takes [batch, texts, sequence] inputs, flattens them to rows of
texts for the encoder, pools one vector per text (its `embedding` output) and computes the loss
from the vectors (`popbert.tasks.embedding`). `TextRows` cuts the lowered graph there into two
graphs over the same weights: the encoder (flattened text rows → vectors) and the loss (vectors
→ loss). A step then runs the encoder over every text of the micro-batch in groups of similar
length, each cut to its own longest text (`popbert.runtime.groups`: an anchor of 20 tokens is
not padded to its positive's 128, nor to the longest anchor of its batch, which
sentence-transformers does), and the loss once over all the vectors, in the rows' order: the
loss and gradients of the padded pass, with the padding left out.

The cached mode (`gradient_cache_rows`; gradient caching, Gao et al. 2021, as
sentence-transformers' `CachedMultipleNegativesRankingLoss`) runs the encoder `rows` rows at a
time: every chunk without gradients, keeping only its vectors (and its random state, so dropout
draws the same masks again); the loss over all the vectors and its gradient with respect to
them; every chunk again with gradients, back-propagating its share. One chunk's activations are
alive at a time, and the gradients are the whole micro-batch's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

from popbert.lowering.functional import onnx_identity
from popbert.runtime.groups import length_groups, text_lengths
from popbert.runtime.inputs import trimmed_width

CUT = "embedding"  # the output the graph is cut at: [texts, hidden]
TEXT_INPUTS = ("input_ids", "segment_ids", "input_mask")  # the inputs with a texts axis

__all__ = ["CUT", "TEXT_INPUTS", "TextRows", "has_text_rows"]


def has_text_rows(module: fx.GraphModule, output_names: Sequence[str]) -> bool:
    """Whether the lowered graph is an embedding training graph: an `embedding` output and a
    loss after it."""
    return CUT in output_names and len(output_names) > 1


def _ancestors(outputs: Sequence[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            stack.extend(node.all_input_nodes)
    return seen


def _subgraph(module: fx.GraphModule, inputs: Mapping[fx.Node, str],
              outputs: Sequence[fx.Node]) -> fx.GraphModule:
    """The nodes of `module` that compute `outputs` from `inputs` (each a placeholder of the
    new graph), as a GraphModule over the same weights (get_attr reads `module`'s own)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(name) for node, name in inputs.items()}
    needed = _ancestors(outputs, set(inputs))
    for node in module.graph.nodes:
        if node in needed and node not in env:
            if node.op == "placeholder":
                raise ValueError(f"the graph part cut at {CUT!r} reads the input {node.name!r} "
                                 "it was not given")
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(module, graph)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None],
                   device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class TextRows:
    """The encoder and the loss of an embedding training graph, over its weights."""

    def __init__(self, module: fx.GraphModule, input_names: Sequence[str],
                 output_names: Sequence[str], device: torch.device, trim: bool,
                 cache_rows: int | None = None):
        self.device, self.trim, self.cache_rows = device, trim, cache_rows
        nodes = list(module.graph.nodes)
        placeholders = dict(zip(input_names, (n for n in nodes if n.op == "placeholder")))
        values = next(n for n in nodes if n.op == "output").args[0]
        vectors = values[list(output_names).index(CUT)]
        while vectors.op == "call_function" and vectors.target is onnx_identity:
            vectors = vectors.args[0]
        # The encoder reads the flattened texts: each text input's one user.
        flat = {}
        for name in TEXT_INPUTS:
            if name in placeholders:
                users = list(placeholders[name].users)
                if len(users) != 1:
                    raise ValueError(f"input {name!r} is not read once (flattened to rows of "
                                     "texts): not an embedding training graph")
                flat[users[0]] = name
        self.text_inputs = list(flat.values())
        self.encoder = _subgraph(module, flat, [vectors])
        self.loss_names = [n for n in output_names if n != CUT]
        losses = [values[list(output_names).index(n)] for n in self.loss_names]
        reads = [n for n in _ancestors(losses, {vectors}) if n.op == "placeholder"]
        self.loss_inputs = [name for name, node in placeholders.items() if node in reads]
        self.loss = _subgraph(module, {vectors: "vectors", **{placeholders[n]: n for n in
                                                               self.loss_inputs}}, losses)

    def _encode(self, micro: Mapping[str, torch.Tensor], rows: slice, text: int) -> torch.Tensor:
        """The vectors [rows, hidden] of one text slot of `rows` rows, trimmed to its longest."""
        mask = micro["input_mask"][rows, text]
        width = trimmed_width(mask) if self.trim else mask.shape[-1]
        feeds = [torch.as_tensor(micro[name][rows, text, :width]).to(self.device)
                 for name in self.text_inputs]
        return self.encoder(*feeds)[0]

    def _encode_grouped(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The vectors [rows · texts, hidden] of every text of `micro`, in groups of similar
        length (`popbert.runtime.groups.length_groups`), each cut to its longest."""
        mask = torch.as_tensor(micro["input_mask"])
        full = mask.shape[-1]
        flat_mask = mask.reshape(-1, full)
        groups = length_groups(text_lengths(flat_mask))
        flat = {name: torch.as_tensor(micro[name]).reshape(-1, full)
                for name in self.text_inputs}
        parts = []
        for group in groups:
            width = min(full, trimmed_width(flat_mask[group]))
            index = torch.from_numpy(group)
            parts.append(self.encoder(*[flat[name][index, :width].to(self.device)
                                        for name in self.text_inputs])[0])
        order = torch.from_numpy(np.concatenate(groups)).to(self.device)
        return torch.cat(parts).index_select(0, torch.argsort(order))

    def _losses(self, vectors: torch.Tensor, micro: Mapping[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        feeds = [torch.as_tensor(micro[name]).to(self.device) for name in self.loss_inputs]
        return dict(zip(self.loss_names, self.loss(vectors, *feeds)))

    def step(self, micro: Mapping[str, torch.Tensor], loss_name: str, weight: float
             ) -> dict[str, torch.Tensor]:
        """Back-propagate `weight` x the loss of `micro` into the weights' gradients; returns
        the loss part's outputs."""
        rows, texts = micro["input_mask"].shape[:2]
        if not self.cache_rows:
            if self.trim:
                vectors = self._encode_grouped(micro)
            else:
                every = slice(0, rows)
                vectors = torch.stack([self._encode(micro, every, t) for t in range(texts)],
                                      dim=1).reshape(rows * texts, -1)
            outputs = self._losses(vectors, micro)
            (outputs[loss_name].float() * weight).backward()
            return {k: v.detach() for k, v in outputs.items()}
        chunks = [slice(s, min(s + self.cache_rows, rows)) for s in range(0, rows,
                                                                         self.cache_rows)]
        states, parts = [], []
        with torch.no_grad():
            for chunk in chunks:
                for text in range(texts):
                    states.append(_rng_state(self.device))
                    parts.append(self._encode(micro, chunk, text))
        width = parts[0].shape[-1]
        cached = torch.zeros(rows, texts, width, device=self.device)
        for index, (chunk, text) in enumerate((c, t) for c in chunks for t in range(texts)):
            cached[chunk, text] = parts[index]
        cached = cached.reshape(rows * texts, width).requires_grad_(True)
        outputs = self._losses(cached, micro)
        (outputs[loss_name].float() * weight).backward()
        grad = cached.grad.reshape(rows, texts, width)
        after = _rng_state(self.device)
        for index, (chunk, text) in enumerate((c, t) for c in chunks for t in range(texts)):
            _set_rng_state(states[index], self.device)
            torch.autograd.backward(self._encode(micro, chunk, text), grad[chunk, text])
        _set_rng_state(after, self.device)
        return {k: v.detach() for k, v in outputs.items()}

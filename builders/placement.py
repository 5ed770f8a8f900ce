"""Layer → (device, pipeline stage) placement, following Graphcore's BERT on IPU-PODs.

Embeddings sit on device 0 in stage 0. Device d holds `layers_per_ipu[d]` consecutive encoder
layers in stage d (a leading 0 gives the embeddings a device of their own, the Base layout).
The MLM and NSP heads go back to device 0 as the last stage, so the word embedding and the tied
MLM projection are one tensor on one device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from popbert.builders.bert_config import BertConfig
from popbert.graph.builder import Builder


@dataclass(frozen=True)
class Placement:
    device: int
    stage: int


class PlacementPlan:
    """Where each part of the model runs; `None` placement means no annotations at all."""

    def __init__(self, config: BertConfig):
        self.enabled = config.layers_per_ipu is not None
        counts = list(config.layers_per_ipu or [config.num_layers])
        if sum(counts) != config.num_layers:
            raise ValueError(f"model.layers_per_ipu {counts} places {sum(counts)} layers but "
                             f"model.num_layers is {config.num_layers}")
        self.layers: list[Placement] = []
        self.last_on_device: set[int] = set()
        for device, count in enumerate(counts):
            for _ in range(count):
                self.layers.append(Placement(device, device))
            if count:
                self.last_on_device.add(len(self.layers) - 1)
        self.embeddings = Placement(0, 0)
        self.heads = Placement(0, len(counts))
        self.num_stages = len(counts) + 1

    def checkpoint_layer(self, layer: int) -> bool:
        """Recompute checkpoints go on every layer output except each device's last."""
        return layer not in self.last_on_device

    @contextlib.contextmanager
    def scope(self, b: Builder, where: Placement) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with b.virtualGraph(where.device), b.pipelineStage(where.stage):
            yield

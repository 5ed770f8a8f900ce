"""Placement and recompute annotations read back from the proto's node attributes."""

from __future__ import annotations

import functools
import re

import onnx
import pytest

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.graph.annotations import IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE

TINY = dict(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512)
BASE = dict(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
LARGE = dict(
    vocab_size=30522, hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096
)


@functools.cache
def built(shape: tuple, layers_per_ipu: tuple[int, ...]) -> onnx.ModelProto:
    """Real-size graphs with zero weights (fast), built once per module."""
    config = BertConfig(**dict(shape), layers_per_ipu=list(layers_per_ipu), recompute=True)
    return build_bert(config, zeros=True).model()


def placements(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Node name → (device, stage); asserts every node is annotated."""
    found = {}
    for node in model.graph.node:
        values = {a.name: a.i for a in node.attribute if a.name in (IPU_NUMBER, PIPELINE_STAGE)}
        assert set(values) == {IPU_NUMBER, PIPELINE_STAGE}, f"{node.name} is not placed"
        found[node.name] = (values[IPU_NUMBER], values[PIPELINE_STAGE])
    return found


def where(found: dict[str, tuple[int, int]], prefix: str) -> set[tuple[int, int]]:
    return {p for name, p in found.items() if name.startswith(prefix)}


def layer_devices(found: dict[str, tuple[int, int]], layers: int) -> list[tuple[int, int]]:
    result = []
    for i in range(layers):
        (placement,) = where(found, f"Layer{i}/")
        result.append(placement)
    return result


@pytest.mark.parametrize(
    "shape, layers_per_ipu",
    [
        (TINY, [1, 1]),
        (BASE, [0, 4, 4, 4]),
        (LARGE, [3, 7, 7, 7]),
    ],
)
def test_graphcore_placement(shape: dict, layers_per_ipu: list[int]) -> None:
    config = BertConfig(**shape, layers_per_ipu=layers_per_ipu, recompute=True)
    model = built(tuple(shape.items()), tuple(layers_per_ipu))
    found = placements(model)
    heads_stage = len(layers_per_ipu)
    assert where(found, "Embedding/") == {(0, 0)}
    expected = [(d, d) for d, n in enumerate(layers_per_ipu) for _ in range(n)]
    assert layer_devices(found, config.num_layers) == expected
    # MLM and NSP heads, and the tied projection, back on device 0 as the last stage.
    assert where(found, "CLS/") == {(0, heads_stage)}
    assert where(found, "NSP/") == {(0, heads_stage)}
    assert where(found, "Loss/") == {(0, heads_stage)}
    tied = next(n for n in model.graph.node if n.name.startswith("CLS/TiedProjection"))
    assert list(tied.input) == ["Embedding/Embedding_Dict"]


def test_recompute_checkpoints_every_layer_output_but_each_devices_last() -> None:
    model = built(tuple(LARGE.items()), (3, 7, 7, 7))
    checkpointed = set()
    for node in model.graph.node:
        if any(a.name == RECOMPUTE and a.i == 1 for a in node.attribute):
            assert node.op_type == "Identity"
            checkpointed.add(int(re.match(r"Layer(\d+)/", node.input[0]).group(1)))
    last_on_device = {2, 9, 16, 23}
    assert checkpointed == set(range(24)) - last_on_device


def test_no_placement_means_no_annotations() -> None:
    model = build_bert(BertConfig(**TINY, recompute=True), zeros=True).model()
    for node in model.graph.node:
        assert not [a.name for a in node.attribute if a.name.startswith("__")], node.name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(layers_per_ipu=[1, 2]), "places 3 layers but model.num_layers is 2"),
        (dict(num_heads=3), "hidden_size .128. must be divisible by model.num_heads .3."),
        (dict(sequence_length=1024), "exceeds model.max_position_embeddings"),
        (dict(hidden_dropout=1.5), "hidden_dropout"),
    ],
)
def test_impossible_configs_fail_at_build_time(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_bert(BertConfig(**{**TINY, **overrides}), zeros=True)

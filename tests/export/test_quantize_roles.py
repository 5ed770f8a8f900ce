"""Every encoder weight matrix of every family has a quantizer role.

`popbert.export.quantize` leaves a weight whose name matches no role in FP32 as part of a task head;
a family whose layer weights were named differently would silently stay FP32 in an "INT8"
export. This walks the built graph of each family: every matrix multiplied inside an encoder
layer (`Layer<i>/...`) has a role that is not "head".
"""

from __future__ import annotations

import pytest
from bert_helpers import small_config

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import ARCHITECTURES
from popbert.export.quantize import HEAD, weight_role

FAMILY_OVERRIDES = {
    "bert": {},
    "groupbert": {"architecture": "groupbert"},
    "modernbert": {"architecture": "modernbert", "next_sentence_prediction": False},
}


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_every_layer_matrix_has_a_role(family: str) -> None:
    model = build_bert(small_config(**FAMILY_OVERRIDES[family]), zeros=True).model()
    weights = {t.name for t in model.graph.initializer if len(t.dims) >= 2}
    multiplied = {name for node in model.graph.node if node.op_type == "MatMul"
                  for name in node.input if name in weights and name.startswith("Layer")}
    assert multiplied, family
    assert {w: weight_role(w) for w in multiplied if weight_role(w) == HEAD} == {}

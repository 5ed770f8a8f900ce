"""The family seam changed no graph: BERT and GroupBERT build the same ONNX graphs, byte for
byte, as before `builders/families.py` existed.

The hashes are SHA-256 of each graph's deterministic serialization (the `GraphProto`: nodes,
names, attributes, annotations, initial weights), recorded from commit 751d18f — the last
before the seam — and checked equal after it. They cover both dialects, placement and
recomputation annotations, dropout, packed rows, MLM-only, symbolic sequences and the squad,
classification and encoder heads. A change that alters any of these graphs fails here; if it is
meant, record the new hashes and say why in the commit.
"""

from __future__ import annotations

import hashlib

import pytest
from bert_helpers import small_config

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import ARCHITECTURES, TaskConfig
from popbert.builders.families import FAMILIES, family_of

GROUPBERT = dict(architecture="groupbert")  # model.groupbert: the defaults (4, 7, 16)
CLASSIFY_2 = {"task": "classification", "with_loss": False, "dynamic_sequence": True}
CASES = {  # name: (model overrides, build_bert arguments)
    "bert-onnx": (dict(), {}),
    "bert-dropout-placed": (dict(hidden_dropout=0.1, attention_dropout=0.1,
                                 layers_per_ipu=[1, 1], recompute=True), {}),
    "bert-popart": (dict(dialect="popart", hidden_dropout=0.1, attention_dropout=0.1,
                         layers_per_ipu=[0, 1, 1]), {"batch_size": 2}),
    "bert-packed": (dict(packed=True), {}),
    "bert-mlm-only": (dict(next_sentence_prediction=False), {}),
    "bert-dynamic-encoder": (dict(), {"task": "encoder", "with_loss": False,
                                      "dynamic_sequence": True}),
    "bert-squad": (dict(task=TaskConfig(name="squad")), {"task": "squad"}),
    "bert-classification": (dict(task=TaskConfig(name="classification", num_labels=3)),
                            {"task": "classification", "dynamic_sequence": True}),
    "groupbert-onnx": (dict(GROUPBERT), {}),
    "groupbert-packed": (dict(GROUPBERT, packed=True), {}),
    "groupbert-popart": (dict(GROUPBERT, dialect="popart", layers_per_ipu=[1, 1],
                              recompute=True), {"batch_size": 2}),
    "groupbert-dynamic-cls": (dict(GROUPBERT, task=TaskConfig(name="classification",
                                                             num_labels=2)), CLASSIFY_2),
}

BEFORE_THE_SEAM = {
    "bert-onnx": "1479a6ece82c435094add72c642c6f0b17a37e0d154a51d4f051cc95f23a30c4",
    "bert-dropout-placed": "d546df35115170ecc53a353c6823f0b2ff2e85fbe5a9bce4db65d121d0682955",
    "bert-popart": "2e4eb57892fc14cdcce0206e27b4ab429265f0b7329df27e1796950ff1968df3",
    "bert-packed": "9fe80089697a8633d044e3ef8cb86124eea558b26b6e1013c3d28aa5f23e2863",
    "bert-mlm-only": "28958f7fce8bdba3738605efa99f5ce78a3a549164fcc50e9cddae550512e01d",
    "bert-dynamic-encoder": "91f75264270de9f961037f1b1e79b70fe38ae5dc7f4f7eb65c8c8b7c3dc26a28",
    "bert-squad": "55756700c0c754c8eaa28f65a07f86e443f26525dc9db36137bfe0fc6a68847b",
    "bert-classification": "9a2a77a45fd3a1274e8a91df1702f24d98b1ebdcd924e08c17bba5cfdd8962d1",
    "groupbert-onnx": "832339db1568b2e43dfeb1e3bf1f7e734cedaf23591aecae701507d0bb97e935",
    "groupbert-packed": "057198e0aa739513ad6ce1382cb96628ded7779c82f81acf398cac8e7d1ef208",
    "groupbert-popart": "858dc553bf01f2753ac6b33d96f4cc92186a608c249ffe6e0439a3094c62a702",
    "groupbert-dynamic-cls": "7336ea2487a255fc69faf3becbfb2f956705d62ea197aa8df99674eed10d50a6",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_is_byte_identical_to_before_the_family_seam(name: str) -> None:
    overrides, arguments = CASES[name]
    # every row of the last layer, as before; without `all_rows` a BERT classifier's last layer
    # computes [CLS] alone (tests/builders/test_first_row_layer.py: the same outputs)
    graph = build_bert(small_config(**overrides), **arguments, all_rows=True).model().graph
    digest = hashlib.sha256(graph.SerializeToString(deterministic=True)).hexdigest()
    assert digest == BEFORE_THE_SEAM[name]


def test_every_architecture_is_one_family() -> None:
    for name in ARCHITECTURES:
        assert family_of(small_config(architecture=name)).name == name
    assert set(FAMILIES) == set(ARCHITECTURES)

"""A head that reads only the pooled [CLS] output (classification, regression, cross-encoders)
gets a last layer computed for [CLS] alone (`build_bert`, `Family.first_row_layer`): keys and
values from every row, the query, the output projection, the norms and the FFN for row 0. BERT
and ModernBERT with `classifier_pooling: cls` have it; GroupBERT (whose convolution mixes
neighbouring rows) and ModernBERT's mean pooling keep every row.

The reference is the same graph with every row (`all_rows=True`), the same weights. Only the
GEMMs' shapes differ (a [B, H] product where the full graph has [B·S, H]), so the kernels may
sum in another order: outputs to 1e-5 of their largest value, gradients to 1e-5 of each
tensor's largest (measured about 1e-7).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import one_thread, small_config  # noqa: F401 (one_thread: autouse)

import popbert.tasks  # noqa: F401 (registers the task heads build_bert reads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import TaskConfig
from popbert.builders.modernbert_config import ModernBertOptions
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import InferenceSession, TrainingSession

HEADS = {"classification": TaskConfig(name="classification", num_labels=3),
         "regression": TaskConfig(name="classification", num_labels=1)}
FAMILIES = {"bert": {}, "modernbert": {"architecture": "modernbert",
                                       "next_sentence_prediction": False}}


def rows(labels: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Four rows padded to 32, of 32, 20, 5 and 13 real tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 300, (4, 32))
    mask = np.zeros_like(ids)
    for row, length in enumerate((32, 20, 5, 13)):
        mask[row, :length] = 1
    arrays = {"input_ids": ids * mask, "segment_ids": np.zeros_like(ids), "input_mask": mask}
    if labels == "classification":
        arrays["labels"] = rng.integers(0, 3, 4)
    elif labels == "regression":
        arrays["labels"] = rng.normal(size=4).astype(np.float32)
    return arrays


def close(ours: torch.Tensor, reference: torch.Tensor, name: str) -> None:
    assert ours.shape == reference.shape, name
    assert (ours - reference).abs().max() <= 1e-5 * reference.abs().max() + 1e-8, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("attention_dropout", [0.0, 0.1], ids=["fused-op", "explicit-chain"])
def test_inference_gives_the_full_layers_logits(family: str, dynamic: bool,
                                                attention_dropout: float) -> None:
    """Both attention forms (the opset-23 `Attention` op, and with dropout in the config the
    explicit chain), static and symbolic sequence axes."""
    config = small_config(**FAMILIES[family], task=HEADS["classification"],
                          attention_dropout=attention_dropout, hidden_dropout=attention_dropout)
    logits = [InferenceSession(build_bert(config, task="classification", seed=3,
                                          with_loss=False, dynamic_sequence=dynamic,
                                          all_rows=every).model()).run(rows())["logits"]
              for every in (True, False)]
    close(logits[1], logits[0], "logits")


def test_the_popart_dialect_cuts_the_last_layer_alike() -> None:
    """PopART's dialect: opset 11, static shapes, the explicit attention chain."""
    config = small_config(task=HEADS["classification"], dialect="popart")
    logits = [InferenceSession(build_bert(config, task="classification", seed=3,
                                          with_loss=False, batch_size=4,
                                          all_rows=every).model()).run(rows())["logits"]
              for every in (True, False)]
    close(logits[1], logits[0], "logits")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("trim", [False, True], ids=["padded", "trimmed"])
def test_a_training_step_gives_the_full_layers_loss_and_gradients(family: str, head: str,
                                                                  trim: bool) -> None:
    config = small_config(**FAMILIES[family], task=HEADS[head])
    results = []
    for every in (True, False):
        proto = build_bert(config, task="classification", seed=3, dynamic_sequence=trim,
                           all_rows=every).model()
        session = TrainingSession(proto, "loss",
                                  lambda p: torch.optim.SGD([x for _, x in p], lr=0.0),
                                  SessionOptions(trim_padding=trim))
        batch = {k: torch.from_numpy(v) for k, v in rows(head).items()}
        out = session.train_step([batch])
        results.append((out, {n: p.grad.clone() for n, p in session.named_parameters}))
    (full, full_grads), (ours, our_grads) = results
    close(ours["loss"], full["loss"], "loss")
    assert full_grads.keys() == our_grads.keys()
    for name, grad in full_grads.items():
        close(our_grads[name], grad, name)


def ffn_rows(model: onnx.ModelProto, layer: int) -> list:
    """The static shape of layer `layer`'s first FFN product."""
    inferred = onnx.shape_inference.infer_shapes(model)
    output = next(n.output[0] for n in inferred.graph.node
                  if n.name.startswith(f"Layer{layer}/FF/1/") and n.op_type == "MatMul")
    info = next(v for v in inferred.graph.value_info if v.name == output)
    return [d.dim_value or d.dim_param for d in info.type.tensor_type.shape.dim]


def test_only_the_last_layer_is_cut_to_the_first_row() -> None:
    config = small_config(task=HEADS["classification"], num_layers=3)
    model = build_bert(config, task="classification", with_loss=False, zeros=True).model()
    assert ffn_rows(model, 1)[1:] == [32, 128]
    assert ffn_rows(model, 2)[1:] == [1, 128]


@pytest.mark.parametrize("family,task", [
    ("bert", "token-classification"), ("bert", "squad"), ("bert", "embedding"),
    ("bert", "pretraining"), ("bert", "encoder"), ("groupbert", "classification"),
    ("modernbert-mean", "classification"), ("modernbert", "token-classification")])
def test_other_heads_and_families_keep_every_row(family: str, task: str) -> None:
    """Heads that read the tokens, families without a first-row layer and ModernBERT's mean
    pooling build the graph `all_rows=True` builds."""
    heads = {"token-classification": TaskConfig(name="token-classification", num_labels=3,
                                                labels=["O", "B-X", "I-X"]),
             "squad": TaskConfig(name="squad"), "embedding": TaskConfig(name="embedding"),
             "classification": HEADS["classification"]}
    options = {"groupbert": {"architecture": "groupbert"}, "modernbert": FAMILIES["modernbert"],
               "modernbert-mean": {**FAMILIES["modernbert"],
                                   "modernbert": ModernBertOptions(classifier_pooling="mean")}}
    config = small_config(**options.get(family, {}), task=heads.get(task, TaskConfig()))
    graphs = [build_bert(config, task=task, with_loss=task != "embedding", zeros=True,
                         all_rows=every).model().graph
              for every in (True, False)]
    assert graphs[0].SerializeToString(deterministic=True) == \
        graphs[1].SerializeToString(deterministic=True)

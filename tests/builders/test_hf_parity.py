"""The BERT graph, lowered to torch, against `transformers.BertForPreTraining` (same weights).

Tolerances: forward values 1e-5 absolute — both sides are FP32 with the same op order up to
matmul blocking, so differences are a few ulps of O(1)-O(10) values. Gradients 1e-4 relative to
each tensor's largest gradient (plus 1e-7 absolute for analytically-zero gradients): backward
sums over batch and positions in a different order
(fused QKV, tied projection) and accumulates more rounding than the forward pass.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import hf_model, hf_pretraining_forward, padded_batch, small_config

from popbert.builders.bert import build_bert
from popbert.graph.annotations import trainable_initializers
from popbert.hf import mapping as hf
from popbert.runtime.session import InferenceSession, TrainingSession


def initializer_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("layers", [2, 4])
def test_forward_and_gradients_match_hugging_face(layers: int) -> None:
    torch.manual_seed(0)
    config = small_config(num_layers=layers)
    model = build_bert(config, seed=layers).model()
    weights = initializer_weights(model)
    reference = hf_model(config, hf.to_hf(weights, config))
    reference.train()  # dropout is 0: train mode must still match

    batch = padded_batch(config, batch_size=4, seed=layers)
    session = TrainingSession(model, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0.0))
    ours = session.forward(batch)
    ours["loss"].backward()

    theirs, their_mlm = hf_pretraining_forward(reference, batch, config)
    theirs.loss.backward()

    torch.testing.assert_close(ours["mlm_logits"], their_mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        ours["nsp_logits"], theirs.seq_relationship_logits, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(ours["loss"], theirs.loss, atol=1e-5, rtol=0)
    nsp = torch.nn.functional.cross_entropy(
        theirs.seq_relationship_logits, torch.from_numpy(batch["next_sentence_labels"])
    )
    torch.testing.assert_close(ours["nsp_loss"], nsp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["mlm_loss"], theirs.loss - nsp, atol=1e-5, rtol=0)

    our_grads = {n: p.grad.numpy() for n, p in session.named_parameters}
    their_params = dict(reference.named_parameters())
    mapped = hf.to_hf(our_grads, config, include_tied=False)
    assert set(mapped) <= set(their_params)
    for name, grad in mapped.items():
        expected = their_params[name].grad.numpy()
        # Relative to the tensor's largest gradient, plus an absolute floor for tensors whose
        # gradient is analytically zero (the key bias: softmax ignores a per-row constant),
        # where both sides hold only rounding noise of order 1e-9.
        error = float(np.abs(grad - expected).max())
        allowed = 1e-4 * float(np.abs(expected).max()) + 1e-7
        assert error <= allowed, f"{name}: gradient error {error:.2e} > {allowed:.2e}"


def test_weights_round_trip_through_hugging_face_names_bit_exactly() -> None:
    config = small_config()
    model = build_bert(config, seed=3).model()
    weights = initializer_weights(model)
    trainable = {k: weights[k] for k in trainable_initializers(model)}
    back, missing = hf.from_hf(hf.to_hf(trainable, config), config)
    assert not missing
    assert set(back) == set(trainable)
    for name, value in back.items():
        np.testing.assert_array_equal(value, trainable[name])


def test_from_hf_reports_missing_heads_for_a_bare_encoder() -> None:
    config = small_config()
    weights = initializer_weights(build_bert(config).model())
    encoder_only = {
        k[len("bert.") :]: v for k, v in hf.to_hf(weights, config).items() if k.startswith("bert.")
    }
    back, missing = hf.from_hf(encoder_only, config)
    assert "Layer0/Attention/QKV/W" in back
    assert set(missing) == {r.ours for r in hf.head_rules()}


def test_inference_session_matches_hugging_face_eval() -> None:
    config = small_config(hidden_dropout=0.1, attention_dropout=0.1)
    model = build_bert(config, with_loss=False, seed=5).model()
    reference = hf_model(config, hf.to_hf(initializer_weights(model), config)).eval()
    batch = padded_batch(config, seed=9)
    ours = InferenceSession(model).run(batch)
    with torch.no_grad():
        theirs = reference(
            input_ids=torch.from_numpy(batch["input_ids"]),
            attention_mask=torch.from_numpy(batch["input_mask"]),
            token_type_ids=torch.from_numpy(batch["segment_ids"]),
        )
    torch.testing.assert_close(
        ours["nsp_logits"], theirs.seq_relationship_logits, atol=1e-5, rtol=0
    )

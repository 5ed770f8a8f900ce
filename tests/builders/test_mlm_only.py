"""MLM-only pre-training (`model.next_sentence_prediction: false`) against `transformers`'
`BertForMaskedLM`, the class its users pre-train with, on the same weights.

Tolerances as in test_hf_parity.py and for the same reasons: loss and logits 1e-5 absolute (FP32
both sides, same op order up to matmul blocking), gradients 1e-4 of each tensor's largest.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import hf_labels, one_thread, padded_batch, small_config  # noqa: F401

from popbert.builders.bert import build_bert
from popbert.hf import mapping as hf
from popbert.rules import Invalid
from popbert.runtime.session import TrainingSession


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def _masked_lm(config, hf_weights: dict[str, np.ndarray]):
    import transformers

    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layer_norm_eps)
    hf_config._attn_implementation = "eager"
    model = transformers.BertForMaskedLM(hf_config)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_weights.items()
             if "pooler" not in k and "seq_relationship" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k], missing
    return model


def test_mlm_only_graph_has_no_nsp_inputs_or_weights() -> None:
    graph = build_bert(small_config(next_sentence_prediction=False), zeros=True)
    model = graph.model()
    names = {t.name for t in model.graph.initializer}
    assert not [n for n in names if n.startswith("NSP")]  # neither pooler nor classifier
    assert "next_sentence_labels" not in graph.inputs
    assert set(graph.outputs) == {"mlm_logits", "loss", "mlm_loss", "mlm_accuracy"}
    full = {t.name for t in build_bert(small_config(), zeros=True).model().graph.initializer}
    assert names < full and {n for n in full - names if not n.startswith("NSP")} == set()


def test_mlm_only_loss_and_gradients_match_bert_for_masked_lm() -> None:
    torch.manual_seed(0)
    config = small_config(next_sentence_prediction=False)
    model = build_bert(config, seed=3).model()
    weights = _weights(model)
    reference = _masked_lm(config, hf.to_hf(weights, config))
    reference.train()

    batch = padded_batch(config, batch_size=4, seed=3)
    batch["segment_ids"][:] = 0
    session = TrainingSession(model, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0.0))
    ours = session.forward(batch)
    ours["loss"].backward()
    theirs = reference(input_ids=torch.from_numpy(batch["input_ids"]),
                       attention_mask=torch.from_numpy(batch["input_mask"]),
                       token_type_ids=torch.from_numpy(batch["segment_ids"]),
                       labels=hf_labels(batch, config.sequence_length))
    theirs.loss.backward()
    torch.testing.assert_close(ours["loss"], theirs.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["mlm_loss"], ours["loss"], atol=0, rtol=0)
    positions = torch.from_numpy(batch["masked_lm_positions"])
    their_logits = torch.gather(theirs.logits, 1,
                                positions[..., None].expand(-1, -1, config.vocab_size))
    torch.testing.assert_close(ours["mlm_logits"], their_logits, atol=1e-5, rtol=0)

    grads = hf.to_hf({n: p.grad.numpy() for n, p in session.named_parameters}, config,
                     include_tied=False)
    theirs_named = dict(reference.named_parameters())
    assert grads and set(grads) <= set(theirs_named)
    for name, grad in grads.items():
        expected = theirs_named[name].grad.numpy()
        error = float(np.abs(grad - expected).max())
        assert error <= 1e-4 * float(np.abs(expected).max()) + 1e-7, name
    # Negative control: the NSP graph's loss on the same batch is not the MLM-only loss.
    nsp_session = TrainingSession(build_bert(small_config(), seed=3).model(), "loss",
                                  lambda p: torch.optim.SGD([x for _, x in p], lr=0.0))
    assert abs(float(nsp_session.forward(batch)["loss"]) - float(theirs.loss)) > 1e-2


def test_packed_rows_are_refused_without_nsp() -> None:
    with pytest.raises(Invalid, match="model.packed packs sentence pairs"):
        small_config(next_sentence_prediction=False, packed=True).validate()

"""ModernBERT built by popbert's Builder against `transformers.ModernBert*` with the same weights.

Random `transformers` weights (no hub is reachable; norms and biases perturbed so none is a
neutral 1 or 0) are mapped onto popbert's names by `popbert.hf.mapping`; rows of unequal
length, padded, and longer than the sliding window (4 tokens each side) go through both.

Tolerances, all FP32: forward outputs within 1e-5 of the largest magnitude of the reference
(measured: 6e-8 on MLM logits, 4e-7 on hidden states of magnitude 3 — the two compute the same
function with different kernels: the fused `Attention` op and precomputed rotary tables against
eager matmuls and rotary angles computed per call); loss curves over 50 AdamW steps within 1e-5
(relative); the popart and onnx dialects lower to the same kernels (the explicit attention chain
runs as the fused `Attention` op does, GroupNormalization as LayerNorm), so they agree bit for
bit, padded and packed. Negative controls show each of the three features the issue names moves
the outputs far outside those bounds.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import one_thread  # noqa: F401 (autouse fixture)
from modernbert_helpers import (
    SEQ,
    hf_model,
    padded_rows,
    popbert_config,
    popbert_weights,
    task_config,
)

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.modernbert import is_global
from popbert.data.packing import pack_instance_arrays
from popbert.graph.annotations import trainable_initializers
from popbert.hf import mapping as hf
from popbert.lowering import lower_to_fx, unescape_param_name
from popbert.rules import Invalid
from popbert.runtime.session import InferenceSession, TrainingSession


def close(ours: np.ndarray, theirs: np.ndarray, rows: np.ndarray | None = None) -> float:
    """max |ours - theirs| over `rows` (a boolean mask of the entries that are real tokens),
    as a fraction of the reference's largest magnitude."""
    if rows is not None:
        ours, theirs = ours[rows], theirs[rows]
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def popbert_outputs(config, weights, batch, task="pretraining", dynamic=False):
    graph = build_bert(config, task=task, with_loss=False, dynamic_sequence=dynamic)
    session = InferenceSession(graph.model())
    session.load_weights(weights, strict=True)
    return {k: v.numpy() for k, v in session.run(batch).items()}


def mlm_at_positions(model, batch) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(batch["input_ids"]),
                       attention_mask=torch.from_numpy(batch["input_mask"])).logits.numpy()
    return np.take_along_axis(logits, batch["masked_lm_positions"][:, :, None], axis=1)


def hidden_states(model, batch) -> np.ndarray:
    with torch.no_grad():
        return model.model(input_ids=torch.from_numpy(batch["input_ids"]),
                           attention_mask=torch.from_numpy(batch["input_mask"])
                           ).last_hidden_state.numpy()


# ----------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("biases", [False, True], ids=["bias-free", "all-biases"])
def test_mlm_logits_and_hidden_states_match_transformers(biases: bool) -> None:
    config = popbert_config(biases)
    model = hf_model("ModernBertForMaskedLM", biases)
    weights = popbert_weights(model, config, "ModernBertForMaskedLM")
    batch = padded_rows()
    ours = popbert_outputs(config, weights, batch)["mlm_logits"]
    assert close(ours, mlm_at_positions(model, batch)) < 1e-5
    # The encoder with a symbolic sequence axis, fed rows of another length (trimmed batches
    # and exports use this graph).
    short = {k: v[:, :24] for k, v in batch.items() if k in ("input_ids", "input_mask")}
    hidden = popbert_outputs(config, {k: v for k, v in weights.items()
                                      if not k.startswith("CLS/")},
                             short, task="encoder", dynamic=True)["last_hidden_state"]
    assert close(hidden, hidden_states(model, short), short["input_mask"] == 1) < 1e-5


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classification_logits_match_transformers(pooling: str) -> None:
    config = popbert_config(modernbert={"classifier_pooling": pooling},
                            task=task_config("classification", num_labels=3))
    model = hf_model("ModernBertForSequenceClassification", classifier_pooling=pooling,
                     num_labels=3)
    weights = popbert_weights(model, config, "ModernBertForSequenceClassification")
    batch = padded_rows()
    ours = popbert_outputs(config, weights, batch, task="classification")["logits"]
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(batch["input_ids"]),
                       attention_mask=torch.from_numpy(batch["input_mask"])).logits.numpy()
    assert close(ours, theirs) < 1e-5


def test_span_logits_match_transformers() -> None:
    config = popbert_config(task=task_config("squad"))
    model = hf_model("ModernBertForQuestionAnswering", num_labels=2)
    weights = popbert_weights(model, config, "ModernBertForQuestionAnswering")
    batch = padded_rows()
    ours = popbert_outputs(config, weights, batch, task="squad")
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(batch["input_ids"]),
                       attention_mask=torch.from_numpy(batch["input_mask"]))
    real = batch["input_mask"] == 1
    assert close(ours["start_logits"], theirs.start_logits.numpy(), real) < 1e-5
    assert close(ours["end_logits"], theirs.end_logits.numpy(), real) < 1e-5


# ----------------------------------------------------------------------------- negative controls


def _first_norm_applied(model) -> None:
    """`transformers` with layer 0's attention norm a real LayerNorm (theirs is the identity)."""
    norm = torch.nn.LayerNorm(64, eps=1e-5, bias=False)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(64))
    model.model.layers[0].attn_norm = norm


@pytest.mark.parametrize("control", ["window-off", "theta-swapped", "first-norm-applied"])
def test_each_modernbert_feature_is_needed_for_parity(control: str) -> None:
    """Each of the window, the per-kind rotary theta and the identity first norm moves the
    logits by far more than the parity bound: the parity test would catch its loss."""
    config = popbert_config()
    model = hf_model("ModernBertForMaskedLM")
    weights = popbert_weights(model, config, "ModernBertForMaskedLM")
    if control == "window-off":
        config = popbert_config(modernbert={"local_attention": 2 * SEQ})
    elif control == "theta-swapped":
        config = popbert_config(modernbert={"global_rope_theta": 10000.0,
                                            "local_rope_theta": 160000.0})
    else:
        _first_norm_applied(model)
    batch = padded_rows()
    ours = popbert_outputs(config, weights, batch)["mlm_logits"]
    assert close(ours, mlm_at_positions(model, batch)) > 50 * 1e-5


def test_layer_kinds_and_bias_free_weights() -> None:
    """Layers 0 and 3 are global (every 3rd from the first, as `transformers`' layer_types);
    the default build has no bias and no LayerNorm beta, as ModernBERT-base."""
    config = popbert_config()
    assert [is_global(config, i) for i in range(4)] == [True, False, False, True]
    names = trainable_initializers(build_bert(config, zeros=True).model())
    assert [n for n in names if n.endswith(("/B", "/Beta", "/Bias"))] == ["CLS/MLM/Bias"]
    assert "Layer0/Attention/Norm/Gamma" not in names and "Layer1/Attention/Norm/Gamma" in names
    assert not any("Positional" in n or "Segment" in n for n in names)


def test_config_checks_name_the_key() -> None:
    with pytest.raises(Invalid, match="model.next_sentence_prediction must be false"):
        popbert_config(next_sentence_prediction=True).validate()
    with pytest.raises(Invalid, match="must be even for rotary"):
        popbert_config(hidden_size=60, num_heads=4).validate()
    with pytest.raises(Invalid, match="model.modernbert.classifier_pooling"):
        popbert_config(modernbert={"classifier_pooling": "max"}).validate()


# ----------------------------------------------------------------------------- training


def test_loss_curve_matches_transformers_over_50_adamw_steps() -> None:
    """The same random weights, batches and `torch.optim.AdamW`: the MLM loss per step within
    1e-5 relative for 50 steps (the logits are compared only at the masked positions, which is
    all popbert's head computes and all `transformers`' loss reads)."""
    config = popbert_config()
    model = hf_model("ModernBertForMaskedLM")
    model.train()
    weights = popbert_weights(model, config, "ModernBertForMaskedLM")
    graph = build_bert(config)
    session = TrainingSession(
        graph.model(), graph.loss,
        lambda named: torch.optim.AdamW([w for _, w in named], lr=2e-3, weight_decay=0.01))
    session.load_weights(weights, strict=True)
    hf_optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    ours, theirs = [], []
    for step in range(50):
        batch = padded_rows(batch=4, seed=step % 2)  # two batches it can learn by heart
        ours.append(float(session.run(batch)["loss"]))
        labels = np.full(batch["input_ids"].shape, -100, np.int64)
        np.put_along_axis(labels, batch["masked_lm_positions"], batch["masked_lm_ids"], axis=1)
        loss = model(input_ids=torch.from_numpy(batch["input_ids"]),
                     attention_mask=torch.from_numpy(batch["input_mask"]),
                     labels=torch.from_numpy(labels)).loss
        hf_optimizer.zero_grad()
        loss.backward()
        hf_optimizer.step()
        theirs.append(float(loss))
    assert ours[-1] < ours[0] - 0.5  # it learned something
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- dialects


def _lowered(model: onnx.ModelProto, batch, weights=None):
    module = lower_to_fx(model)
    trainable = set(trainable_initializers(model))
    params = {unescape_param_name(n): p for n, p in module.named_parameters()
              if unescape_param_name(n) in trainable}
    if weights is not None:
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
    outputs = module.run({n: torch.from_numpy(batch[n]) for n in module.input_names})
    outputs["loss"].backward()
    return ({k: v.detach() for k, v in outputs.items()},
            {n: p.grad.clone() for n, p in params.items()},
            {n: p.detach().clone() for n, p in params.items()})


def _packed_rows() -> dict[str, np.ndarray]:
    from packing_helpers import K, sequences

    padded = sequences(popbert_config(max_predictions_per_seq=4), 7, seed=3)
    packed, _ = pack_instance_arrays(padded, max_sequences_per_pack=K,
                                     max_predictions_per_pack=K * 4, seed=1)
    return {k: v.astype(np.int64) for k, v in packed.items()}


@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_popart_dialect_checks_and_lowers_bit_identically_to_the_onnx_dialect(rows: str) -> None:
    from packing_helpers import K

    if rows == "padded":
        batch, extra = padded_rows(batch=2), {}
    else:
        batch = _packed_rows()
        extra = {"max_predictions_per_seq": K * 4, "packed": True, "max_sequences_per_pack": K}
    # Head dim 24: its 1/sqrt(d) is not a power of two, so a scale applied another way than
    # the fused op's would show in the last bits.
    placed = {"layers_per_ipu": [2, 2], "recompute": True, "hidden_size": 96, **extra}
    onnx_graph = build_bert(popbert_config(**placed), seed=1)
    popart = build_bert(popbert_config(dialect="popart", **placed), seed=3,
                        batch_size=len(batch["input_ids"])).model()
    onnx.checker.check_model(popart)
    assert {o.domain or "ai.onnx": o.version for o in popart.opset_import}["ai.onnx"] == 11
    theirs, their_grads, weights = _lowered(onnx_graph.model(), batch)
    ours, our_grads, _ = _lowered(popart, batch, weights)
    assert set(ours) == set(theirs) and set(our_grads) == set(their_grads)
    for name, expected in theirs.items():
        assert torch.equal(ours[name], expected), name
    for name, expected in their_grads.items():
        assert torch.equal(our_grads[name], expected), name


# ----------------------------------------------------------------------------- weight names


@pytest.mark.parametrize("architecture", ["ModernBertForMaskedLM",
                                          "ModernBertForSequenceClassification",
                                          "ModernBertForQuestionAnswering", "ModernBertModel"])
@pytest.mark.parametrize("biases", [False, True], ids=["bias-free", "all-biases"])
def test_weights_round_trip_through_transformers_names_bit_exactly(architecture: str,
                                                                   biases: bool) -> None:
    """HF state → popbert → HF state gives the same tensors, bit for bit, and every key of the
    `transformers` class (tied aliases aside) is produced."""
    extra = {"num_labels": 3} if "Classification" in architecture else {}
    model = hf_model(architecture, biases, **extra)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = popbert_config(biases)
    weights, missing = hf.from_hf_architecture(state, config, architecture)
    assert not missing
    back = hf.to_hf_architecture(weights, config, architecture, include_tied=True)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert np.array_equal(back[key], value), key
    assert hf.architecture_for(weights, config) == architecture


# ----------------------------------------------------------------------------- unpadded rows


def _loss_and_grads(session: TrainingSession, batch) -> tuple[float, dict[str, torch.Tensor]]:
    session.optimizer.zero_grad(set_to_none=True)
    outputs = session.forward(batch)
    outputs["loss"].backward()
    return float(outputs["loss"]), {n: p.grad.detach().clone()
                                    for n, p in session.named_parameters}


def _sgd(params):
    return torch.optim.SGD([p for _, p in params], lr=0.0)


def _assert_same_training_signal(ours, theirs) -> None:
    """Losses within 1e-6, each gradient within 1e-5 of its tensor's largest."""
    (loss, grads), (expected_loss, expected_grads) = ours, theirs
    assert abs(loss - expected_loss) <= 1e-6
    assert grads.keys() == expected_grads.keys()
    for name, expected in expected_grads.items():
        error = float((grads[name] - expected).abs().max())
        assert error <= 1e-5 * float(expected.abs().max()), (name, error)


def test_packed_rows_equal_the_same_sequences_padded() -> None:
    """Sequences packed several to a row (attention within each, rotary positions restarting,
    the window measured inside each) give the padded rows' loss and gradients."""
    from packing_helpers import K, sequences

    from popbert.data.packing import pack_instance_arrays

    config = popbert_config(max_predictions_per_seq=4)
    padded = sequences(config, 7, seed=3)  # real lengths 5-15, the window 4 each side
    packed, stats = pack_instance_arrays(padded, max_sequences_per_pack=K,
                                         max_predictions_per_pack=K * 4, seed=1)
    packed = {k: v.astype(np.int64) for k, v in packed.items()}
    assert stats.packs < stats.sequences
    packed_config = popbert_config(max_predictions_per_seq=K * 4, packed=True,
                                   max_sequences_per_pack=K)
    model = hf_model("ModernBertForMaskedLM")  # peaked attention: a leak would show
    weights = popbert_weights(model, config, "ModernBertForMaskedLM")
    sessions = []
    for cfg in (config, packed_config):
        session = TrainingSession(build_bert(cfg).model(), "loss", _sgd)
        session.load_weights(weights, strict=True)
        sessions.append(session)
    _assert_same_training_signal(_loss_and_grads(sessions[1], packed),
                                 _loss_and_grads(sessions[0], padded))
    names = [i.name for i in build_bert(packed_config, zeros=True).model().graph.input]
    assert {"position_ids", "sequence_index"} <= set(names) and "segment_ids" not in names


def test_trimmed_rows_equal_the_same_rows_padded() -> None:
    """`execution.trim_padding`: the batch cut to its longest row through the graph with a
    symbolic sequence axis gives the padded batch's loss and gradients."""
    config = popbert_config()
    model = hf_model("ModernBertForMaskedLM")
    weights = popbert_weights(model, config, "ModernBertForMaskedLM")
    batch = padded_rows(batch=4, seed=5)
    batch["input_mask"][0, 20:] = 0  # no full row: the longest is shorter than the graph
    batch["input_ids"] *= batch["input_mask"]
    batch["masked_lm_positions"][0] = np.sort(np.random.default_rng(1).choice(
        np.arange(1, 20), 6, replace=False))
    longest = int(batch["input_mask"].sum(axis=1).max())
    assert longest < SEQ
    trimmed = {k: (v[:, :longest] if k in ("input_ids", "input_mask") else v)
               for k, v in batch.items()}
    static = TrainingSession(build_bert(config).model(), "loss", _sgd)
    dynamic = TrainingSession(build_bert(config, dynamic_sequence=True).model(), "loss", _sgd)
    for session in (static, dynamic):
        session.load_weights(weights, strict=True)
    _assert_same_training_signal(_loss_and_grads(dynamic, trimmed),
                                 _loss_and_grads(static, batch))


def test_parity_on_real_wikipedia_text_through_a_bpe_tokenizer(tmp_path) -> None:
    """The same comparison on real text: bundled Wikipedia sentences through a byte-level BPE
    trained on the bundled corpus (vocabulary 300, the model's), rows of unequal length,
    padded, longer than the window."""
    from popbert.data.tokenization import bundled_corpus_path
    from popbert.data.vocab import train_bpe

    tokenizer = train_bpe([bundled_corpus_path()], tmp_path / "tokenizer.json", vocab_size=300)
    lines = [line for line in bundled_corpus_path().read_text(encoding="utf-8").splitlines()
             if len(line) > 60][:3]
    ids = np.zeros((3, SEQ), np.int64)
    mask = np.zeros((3, SEQ), np.int64)
    for row, line in enumerate(lines):
        tokens = [tokenizer.cls_id, *tokenizer.encode(line)[:SEQ - 2 - 6 * row],
                  tokenizer.sep_id]
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
    assert len(set(mask.sum(axis=1))) == 3 and mask.sum(axis=1).max() > 2 * 4  # > the window
    positions = np.tile(np.arange(1, 7), (3, 1))
    batch = {"input_ids": ids, "input_mask": mask, "masked_lm_positions": positions}
    config = popbert_config()
    model = hf_model("ModernBertForMaskedLM")
    weights = popbert_weights(model, config, "ModernBertForMaskedLM")
    ours = popbert_outputs(config, weights, batch)["mlm_logits"]
    assert close(ours, mlm_at_positions(model, batch)) < 1e-5
    hidden = popbert_outputs(config, {k: v for k, v in weights.items()
                                      if not k.startswith("CLS/")},
                             batch, task="encoder")["last_hidden_state"]
    assert close(hidden, hidden_states(model, batch), mask == 1) < 1e-5

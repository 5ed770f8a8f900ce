"""Packed BERT: a packed batch gives the per-sequence losses and gradients of the same sequences
unpacked (FP32, 1e-5), through the lowered graph in a TrainingSession."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bert_helpers import small_config
from packing_helpers import K, match_rows, only_sequence, sequences

from popbert.builders import bert as bert_mod
from popbert.builders.bert import build_bert
from popbert.data.packing import NSP_IGNORE, pack_instance_arrays
from popbert.runtime.session import TrainingSession

TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    # Weights of std 0.2 (not BERT's 0.02) make attention sharp, so a leak between packed
    # sequences shows far above the tolerance (see the negative control below).
    config = small_config(max_predictions_per_seq=4, initializer_range=0.2)
    unpacked = sequences(config, 7, seed=3)
    packed, stats = pack_instance_arrays(unpacked, max_sequences_per_pack=K,
                                         max_predictions_per_pack=K * 4, seed=1)
    packed = {k: v.astype(np.int64) for k, v in packed.items()}  # what the loader feeds
    assert stats.packs < stats.sequences  # the batch really is packed
    packed_config = small_config(max_predictions_per_seq=K * 4, packed=True,
                                 max_sequences_per_pack=K, initializer_range=0.2)
    sgd = lambda params: torch.optim.SGD([p for _, p in params], lr=0.0)  # noqa: E731
    plain = TrainingSession(build_bert(config, seed=7).model(), "loss", sgd)
    pack = TrainingSession(build_bert(packed_config, seed=7).model(), "loss", sgd)
    # Same seed, same creation order: identical weights under identical names.
    ours, theirs = plain.weights(), pack.weights()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    return config, unpacked, packed, plain, pack


def grads(session, batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    session.optimizer.zero_grad(set_to_none=True)
    outputs = session.forward(batch)
    outputs["loss"].backward()
    outputs = {k: v.detach() for k, v in outputs.items()}
    return outputs, {n: p.grad.detach().clone() for n, p in session.named_parameters}


def test_packed_graph_inputs_and_mask_are_block_diagonal():
    config = small_config(packed=True, max_sequences_per_pack=K)
    model = build_bert(config, zeros=True).model()
    names = [i.name for i in model.graph.input]
    assert {"position_ids", "sequence_index", "cls_positions"} <= set(names)
    assert "input_mask" not in names
    # The unpacked graph is untouched: no new inputs.
    plain = [i.name for i in build_bert(small_config(), zeros=True).model().graph.input]
    assert plain == ["input_ids", "segment_ids", "input_mask", "masked_lm_positions",
                     "masked_lm_ids", "next_sentence_labels"]
    with pytest.raises(ValueError, match="pre-training only"):
        build_bert(config, task="encoder", zeros=True)
    with pytest.raises(ValueError, match="max_sequences_per_pack"):
        small_config(packed=True, max_sequences_per_pack=0).validate()


def test_losses_and_gradients_equal_unpacked(setup):
    config, unpacked, packed, plain, pack = setup
    out_u, grad_u = grads(plain, unpacked)
    out_p, grad_p = grads(pack, packed)
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
        assert abs(float(out_u[key]) - float(out_p[key])) <= TOL, key
    rows = match_rows(unpacked, packed)
    # Per sequence: NSP logits at its [CLS], MLM logits at each of its masked positions.
    for src, (row, slot) in rows.items():
        assert torch.allclose(out_u["nsp_logits"][src], out_p["nsp_logits"][row, slot], atol=TOL)
        start = int(packed["cls_positions"][row, slot])
        npred = int((unpacked["masked_lm_ids"][src] != 0).sum())
        for q in range(npred):
            target = unpacked["masked_lm_positions"][src, q] + start
            slot_q = int(np.nonzero(packed["masked_lm_positions"][row] == target)[0][0])
            assert packed["masked_lm_ids"][row, slot_q] == unpacked["masked_lm_ids"][src, q]
            assert torch.allclose(out_u["mlm_logits"][src, q], out_p["mlm_logits"][row, slot_q],
                                  atol=TOL)
    for name, g in grad_u.items():
        assert torch.allclose(g, grad_p[name], atol=TOL, rtol=0), name


def test_negative_control_leaky_mask_or_wrong_positions_differ(setup):
    """The comparison above can fail: attention across sequences or 0..S-1 positions in a
    packed row change the losses far beyond the tolerance."""
    config, unpacked, packed, plain, pack = setup
    out_u, _ = grads(plain, unpacked)
    leaky = {**packed, "sequence_index": (packed["sequence_index"] > 0).astype(np.int64)}
    shifted = {**packed, "position_ids": np.broadcast_to(
        np.arange(config.sequence_length), packed["position_ids"].shape).copy()}
    for bad in (leaky, shifted):
        out_b, _ = grads(pack, bad)
        assert abs(float(out_u["loss"]) - float(out_b["loss"])) > 100 * TOL


def test_per_sequence_losses_and_gradients(setup):
    config, unpacked, packed, plain, pack = setup
    rows = match_rows(unpacked, packed)
    for src in (0, 3, 6):
        row, slot = rows[src]
        single = {k: v[src:src + 1] for k, v in unpacked.items()}
        out_u, grad_u = grads(plain, single)
        out_p, grad_p = grads(pack, only_sequence(packed, row, slot))
        assert abs(float(out_u["mlm_loss"]) - float(out_p["mlm_loss"])) <= TOL
        assert abs(float(out_u["nsp_loss"]) - float(out_p["nsp_loss"])) <= TOL
        for name, g in grad_u.items():
            assert torch.allclose(g, grad_p[name], atol=TOL, rtol=0), (src, name)


def test_nsp_ignore_matches_builder_constant():
    assert bert_mod.NSP_IGNORE == NSP_IGNORE

"""Attention over packed rows, per sequence: the lowering finds the block-diagonal mask and the
attention reading it, and the per-sequence computation equals the dense masked one on every real
token (FP32, 1e-5 absolute, gradients 2e-6 of their largest value: the same sums in another
order), values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bert_helpers import small_config
from packing_helpers import sequences

from popbert.builders.bert import build_bert
from popbert.data.packing import pack_instance_arrays
from popbert.lowering.block_attention import BUCKET, BlockDiagonalAttention, bucket_plan
from popbert.lowering.lower import lower_to_fx
from popbert.runtime.session import TrainingSession

TOL = 1e-5
GRAD_TOL = 2e-6  # of the gradient's largest magnitude


def packed_segments(lengths_per_row: list[list[int]], width: int) -> torch.Tensor:
    segments = torch.zeros(len(lengths_per_row), width, dtype=torch.int64)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for k, length in enumerate(lengths):
            segments[row, start:start + length] = k + 1
            start += length
    return segments


def qkv(rows: int, width: int, heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(rows, width, heads, dim, generator=g)).transpose(1, 2)
            .requires_grad_() for _ in range(3)]


def run(module: BlockDiagonalAttention, segments, tensors, varlen: bool):
    module.varlen = varlen
    out = module(*tensors, segments)
    # Only real tokens are read downstream (padding outputs differ by design).
    real = (segments > 0)[:, None, :, None]
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weight * real).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach() * real, grads


# Lengths around and across bucket boundaries, rows of 1-3 sequences, a full row, padding.
LENGTHS = [[70, 3, 20], [128], [1, BUCKET, BUCKET + 1], [], [90, 30]]


def test_per_sequence_equals_dense_masked_attention():
    segments = packed_segments(LENGTHS, 128)
    tensors = qkv(len(LENGTHS), 128)
    module = BlockDiagonalAttention(scale=None)
    dense, dense_grads = run(module, segments, tensors, varlen=False)
    per_seq, per_seq_grads = run(module, segments, tensors, varlen=True)
    plan = bucket_plan(segments)
    assert [b.index.shape[1] for b in plan.buckets] == [32, 64, 96, 128]  # really per sequence
    assert sum(int(b.valid.sum()) for b in plan.buckets) == int((segments > 0).sum())
    assert torch.allclose(per_seq, dense, atol=TOL, rtol=0)
    for a, b in zip(per_seq_grads, dense_grads, strict=True):
        # Gradients reach |15|: FP32 reordering scales with them (measured 1.1e-5, 7.7e-7 of
        # the tensor's largest value, on an AVX-512 Xeon; below 1e-5 on AMD EPYC).
        assert torch.allclose(a, b, atol=max(TOL, GRAD_TOL * float(b.abs().max())), rtol=0)
    # Negative control: one sequence spilling into the next changes real outputs.
    leaky = segments.clone()
    leaky[0, 70:73] = 1
    other, _ = run(module, leaky, tensors, varlen=True)
    assert (other[0] - dense[0]).abs().max() > 100 * TOL


def test_runs_not_in_packer_layout_take_the_dense_path():
    """An id that comes back later in a row links both runs in the dense mask; the module
    must not split them (it computes the dense attention instead)."""
    segments = packed_segments([[10, 10], [20]], 40)
    segments[0, 20:30] = 1  # 1 1 2 1 0: sequence 1 is two runs
    tensors = qkv(2, 40)
    module = BlockDiagonalAttention(scale=0.3)
    dense, dense_grads = run(module, segments, tensors, varlen=False)
    out, grads = run(module, segments, tensors, varlen=True)
    assert torch.equal(out, dense)
    assert all(torch.equal(a, b) for a, b in zip(grads, dense_grads, strict=True))


def test_nearly_full_rows_keep_the_dense_attention():
    """Buckets that would save under a tenth of the dense work are not worth moving tokens."""
    assert bucket_plan(packed_segments([[128], [120, 8], [100, 20]], 128)) is None
    assert bucket_plan(packed_segments([[64, 64], [100, 20]], 128)) is not None


def test_dropout_is_seeded_and_only_in_training():
    segments = packed_segments(LENGTHS, 128)
    tensors = [t.detach() for t in qkv(len(LENGTHS), 128)]
    module = BlockDiagonalAttention(scale=None, dropout=0.3)
    torch.manual_seed(5)
    first = module(*tensors, segments)
    torch.manual_seed(5)
    assert torch.equal(module(*tensors, segments), first)  # replayable (recomputation)
    plain = BlockDiagonalAttention(scale=None)(*tensors, segments)
    assert not torch.allclose(first, plain, atol=1e-3)
    module.eval()
    assert torch.allclose(module(*tensors, segments), plain, atol=TOL)


@pytest.mark.parametrize("graph", ["onnx Attention", "onnx with dropout", "popart"])
def test_lowering_finds_packed_attention_in_every_graph_form(graph):
    extra = {"onnx with dropout": dict(attention_dropout=0.1),
             "popart": dict(dialect="popart")}.get(graph, {})
    config = small_config(packed=True, max_sequences_per_pack=3, max_predictions_per_seq=12,
                          **extra)
    batch = {"batch_size": 4} if graph == "popart" else {}
    module = lower_to_fx(build_bert(config, seed=0, **batch).model())
    found = [m for m in module.modules() if isinstance(m, BlockDiagonalAttention)]
    assert len(found) == config.num_layers
    assert found[0].dropout == pytest.approx(extra.get("attention_dropout", 0.0))
    # The dense [B, 1, S, S] mask is gone from the lowered graph (the popart dialect keeps the
    # Cast of its UINT32 sequence_index, which the attention reads).
    left = {n.meta["onnx"]["op_type"] for n in module.graph.nodes
            if "AttentionMask" in n.meta.get("onnx", {}).get("name", "")}
    assert left <= {"Cast"}
    assert any("AttentionMask" in n.name for n in build_bert(config, seed=0, **batch)
               .model().graph.node)  # (the graph does build it)
    if graph != "onnx Attention":
        fused = [n.meta["onnx"].get("fused") for n in module.graph.nodes
                 if n.op == "call_module" and isinstance(module.get_submodule(n.target),
                                                         BlockDiagonalAttention)]
        op_types = [f["op_type"] for f in fused[0]]
        assert op_types[:4] == ["MatMul", "Mul", "Add", "Softmax"]
        assert ("Dropout" in op_types) == ("attention_dropout" in extra)
    # Unpacked graphs (a padding mask, not a block-diagonal one) are left alone.
    plain = lower_to_fx(build_bert(small_config(**extra), seed=0, **batch).model())
    assert not any(isinstance(m, BlockDiagonalAttention) for m in plain.modules())


def test_packed_model_trains_the_same_per_sequence_or_dense():
    """Whole model: per-sequence attention vs the graph's dense masked attention, sequences
    longer than one bucket; loss and every gradient within 1e-5."""
    config = small_config(sequence_length=96, max_position_embeddings=96,
                          max_predictions_per_seq=4, initializer_range=0.2)
    packed, _ = pack_instance_arrays(sequences(config, 9, seed=4), max_sequences_per_pack=3,
                                     max_predictions_per_pack=12, seed=1)
    packed = {k: v.astype(np.int64) for k, v in packed.items()}
    packed_config = small_config(sequence_length=96, max_position_embeddings=96,
                                 max_predictions_per_seq=12, packed=True,
                                 max_sequences_per_pack=3, initializer_range=0.2)
    session = TrainingSession(build_bert(packed_config, seed=7).model(), "loss",
                              lambda params: torch.optim.SGD([p for _, p in params], lr=0.0))
    modules = [m for m in session.module.modules() if isinstance(m, BlockDiagonalAttention)]
    assert modules and bucket_plan(torch.from_numpy(packed["sequence_index"])) is not None
    results = {}
    for varlen in (True, False):
        for m in modules:
            m.varlen = varlen
        session.optimizer.zero_grad(set_to_none=True)
        loss = session.forward(packed)["loss"]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in session.named_parameters}
        results[varlen] = (float(loss.detach()), grads)
    assert abs(results[True][0] - results[False][0]) <= TOL
    for name, grad in results[True][1].items():
        assert torch.allclose(grad, results[False][1][name], atol=TOL, rtol=0), name

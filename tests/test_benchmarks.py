"""The benchmarks import (a refactor once broke one silently), and the step-time benchmark's
Hugging Face peer does the same work as popbert: the same loss on the same weights and batch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnx
import pytest
import torch
from bert_helpers import hf_model, padded_batch

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.hf.mapping import to_hf
from popbert.runtime.session import SessionOptions, TrainingSession

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_benchmark_imports(path: Path) -> None:
    assert callable(getattr(_load(path), "main", None)), f"{path.name} has no main()"


def _small(next_sentence_prediction: bool) -> BertConfig:
    return BertConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2,
                      intermediate_size=128, sequence_length=128, max_predictions_per_seq=20,
                      hidden_dropout=0.0, attention_dropout=0.0,
                      next_sentence_prediction=next_sentence_prediction)


def _popbert_loss(config: BertConfig, one_segment: bool = False) -> tuple[dict, dict, float]:
    """A fresh model's weights, a padded batch, and popbert's loss on them."""
    model = build_bert(config, seed=0).model()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    session = TrainingSession(model, "loss",
                              lambda p: torch.optim.SGD([x for _, x in p], lr=0.0),
                              SessionOptions(device="cpu"))
    batch = {k: torch.from_numpy(v) for k, v in padded_batch(config, 4, seed=1).items()}
    if one_segment:
        batch["segment_ids"].zero_()
    return weights, batch, float(session.run(batch)["loss"][0])


def test_masked_head_peer_computes_popberts_loss() -> None:
    step_time = _load(BENCHMARKS / "step_time.py")
    config = _small(next_sentence_prediction=True)
    weights, batch, ours = _popbert_loss(config)
    peer = hf_model(config, to_hf(weights, config)).eval()
    theirs = float(step_time.masked_head_loss(peer, batch))
    # FP32, same weights: the only difference is kernel summation order (~1e-6 relative).
    assert theirs == pytest.approx(ours, rel=1e-5)


def test_time_to_quality_peer_computes_popberts_mlm_only_loss() -> None:
    """The peer (`BertForMaskedLM` with the masked-positions head) and popbert-same do the same
    work: on the same weights and batch the same MLM-only loss (FP32: ~1e-6 relative)."""
    ttq = _load(BENCHMARKS / "time_to_quality.py")
    import transformers

    config = _small(next_sentence_prediction=False)
    weights, batch, ours = _popbert_loss(config, one_segment=True)
    peer = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=512, attn_implementation="sdpa")).eval()
    state = {k: torch.from_numpy(v.copy()) for k, v in to_hf(weights, config).items()}
    missing, unexpected = peer.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k]
    assert float(ttq.masked_lm_loss(peer, batch)) == pytest.approx(ours, rel=1e-5)


def test_time_to_quality_reads_the_time_a_curve_reaches_a_loss() -> None:
    ttq = _load(BENCHMARKS / "time_to_quality.py")
    curve = [(10.0, 7.0), (20.0, 6.0), (30.0, 5.0)]
    assert ttq.seconds_to_reach(curve, 6.5) == pytest.approx(15.0)  # between two evaluations
    assert ttq.seconds_to_reach(curve, 5.0) == 30.0
    assert ttq.seconds_to_reach(curve, 7.5) == 10.0  # reached by the first evaluation
    assert ttq.seconds_to_reach(curve, 4.0) is None
    # popbert-same's overrides make the peer's recipe: MLM only, BF16, AdamW, its batch.
    from popbert.config import load_config

    cfg = load_config("tiny", ttq.same_recipe_overrides(1e-3))
    assert not cfg.model.next_sentence_prediction and cfg.data.dynamic_masking
    assert cfg.execution.compute_dtype == "bfloat16" and cfg.optimizer.name == "adamw"
    assert cfg.model.hidden_size == ttq.SHAPE["hidden_size"]
    assert cfg.execution.micro_batch_size == ttq.PEER_RECIPE["micro_batch_size"]


def test_inference_ceiling_times_the_encoders_own_gemms() -> None:
    """The ceiling's GEMM graph holds exactly the weight matrices of popbert's encoder (role
    and shape, layer by layer), its operation count is theirs, and the export's quantizer
    makes every one INT8; a graph with a GEMM too few fails the same comparison."""
    from popbert.export.quantize import ROLES, quantize_int8, weight_role

    ceiling = _load(BENCHMARKS / "inference_ceiling.py")
    config = _small(next_sentence_prediction=False)
    encoder = build_bert(config, task="encoder", with_loss=False).model()

    def matrices(model: onnx.ModelProto) -> list[tuple[str, tuple[int, ...]]]:
        return sorted((weight_role(t.name), tuple(t.dims)) for t in model.graph.initializer
                      if len(t.dims) == 2 and weight_role(t.name) in ROLES)

    rows = 8
    gemms = ceiling.gemm_graph(config.num_layers, config.hidden_size, config.intermediate_size,
                               rows)
    assert len(matrices(encoder)) == 4 * config.num_layers
    assert matrices(gemms) == matrices(encoder)
    products = sum(2 * rows * shape[0] * shape[1] for _, shape in matrices(encoder))
    assert ceiling.gemm_ops(config.num_layers, config.hidden_size, config.intermediate_size,
                            rows) == products
    _, counts = quantize_int8(gemms)
    assert counts == {role: config.num_layers for role in ("attention-out", "ffn-in",
                                                           "ffn-out", "qkv")}
    fewer = ceiling.gemm_graph(config.num_layers - 1, config.hidden_size,
                               config.intermediate_size, rows)
    assert matrices(fewer) != matrices(encoder)

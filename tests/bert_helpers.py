"""Shared helpers for tests that build small BERT graphs and padded batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from popbert.builders.bert_config import BertConfig


def small_config(**overrides) -> BertConfig:
    values = dict(
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        sequence_length=32,
        max_predictions_per_seq=6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    values.update(overrides)
    return BertConfig(**values)


def padded_batch(config: BertConfig, batch_size: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Random pre-training batch with varying real lengths, padding and padded MLM slots."""
    rng = np.random.default_rng(seed)
    seq, preds = config.sequence_length, config.max_predictions_per_seq
    input_ids = np.zeros((batch_size, seq), np.int64)
    input_mask = np.zeros((batch_size, seq), np.int64)
    segment_ids = np.zeros((batch_size, seq), np.int64)
    positions = np.zeros((batch_size, preds), np.int64)
    labels = np.zeros((batch_size, preds), np.int64)
    for row in range(batch_size):
        length = int(rng.integers(seq // 2, seq + 1)) if row else seq
        input_ids[row, :length] = rng.integers(5, config.vocab_size, length)
        input_mask[row, :length] = 1
        segment_ids[row, length // 2 : length] = 1
        count = int(rng.integers(1, preds + 1))
        chosen = np.sort(rng.choice(np.arange(1, length), size=count, replace=False))
        positions[row, :count] = chosen
        labels[row, :count] = rng.integers(5, config.vocab_size, count)
    return {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "next_sentence_labels": rng.integers(0, 2, batch_size).astype(np.int64),
    }


def hf_model(config: BertConfig, hf_weights: dict[str, np.ndarray]):
    """A `transformers.BertForPreTraining` with exactly these weights (eager attention)."""
    import transformers

    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size,
        layer_norm_eps=config.layer_norm_eps,
    )
    hf_config._attn_implementation = "eager"
    model = transformers.BertForPreTraining(hf_config)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if "position_ids" not in k], missing
    return model


def hf_pretraining_forward(reference, batch: dict[str, np.ndarray], config: BertConfig):
    """`BertForPreTraining` on a padded batch with its labels; returns (output, MLM logits at the
    batch's masked positions) — popbert's head computes only those."""
    theirs = reference(
        input_ids=torch.from_numpy(batch["input_ids"]),
        attention_mask=torch.from_numpy(batch["input_mask"]),
        token_type_ids=torch.from_numpy(batch["segment_ids"]),
        labels=hf_labels(batch, config.sequence_length),
        next_sentence_label=torch.from_numpy(batch["next_sentence_labels"]),
    )
    positions = torch.from_numpy(batch["masked_lm_positions"])
    mlm = torch.gather(theirs.prediction_logits, 1,
                       positions[..., None].expand(-1, -1, config.vocab_size))
    return theirs, mlm


def hf_labels(batch: dict[str, np.ndarray], seq: int) -> torch.Tensor:
    """NVIDIA-layout MLM labels → HF's [B, S] labels with -100 where not predicted."""
    labels = torch.full((batch["input_ids"].shape[0], seq), -100, dtype=torch.long)
    for row, (pos, ids) in enumerate(zip(batch["masked_lm_positions"], batch["masked_lm_ids"])):
        for p, i in zip(pos, ids):
            if i != 0:
                labels[row, p] = int(i)
    return labels


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread (two spin-wait badly on a shared 2-core machine).
    Autouse in every test module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

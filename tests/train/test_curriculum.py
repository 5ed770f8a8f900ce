"""The sequence-length curriculum (`training.sequence_curriculum`): full rows of contiguous text cut
into shorter rows early in a run and masked anew; the cut keeps every token in order, the stages
follow the run's progress, a run trains on what the stages say and resumes bit-identically, and
what the curriculum cannot do is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch
from bert_helpers import one_thread  # noqa: F401 (autouse)

import popbert
from popbert.data.instances import (
    InstanceOptions,
    cut_chunk_rows,
    mask_arrays,
    unmask_rows,
)
from popbert.data.tokenization import WordPieceTokenizer, bundled_vocab_path
from popbert.errors import ConfigError
from popbert.train.curriculum import SequenceCurriculum

CLS, SEP = 2, 3

# A tiny MLM-only BERT on the bundled corpus: rows of 32 tokens, 16 for the first half of the run.
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=32", "model.max_predictions_per_seq=8",
         "model.next_sentence_prediction=false", "data.dynamic_masking=true",
         "data.masked_lm_prob=0.25", "execution.device=cpu", "execution.micro_batch_size=4",
         "training.log_every=1", "optimizer.warmup_steps=2", "training.steps=8",
         "training.sequence_curriculum=[[0.5, 16]]"]


def small(*overrides: str) -> popbert.RunConfig:
    return popbert.load_config("tiny", [*SMALL, *overrides])


def chunk_rows(lengths: list[int], seq: int = 32) -> dict[str, np.ndarray]:
    """Unmasked `[CLS] body [SEP]` rows with bodies 100, 101, ... (distinct, in order)."""
    ids = np.zeros((len(lengths), seq), np.int64)
    mask = np.zeros_like(ids)
    token = 100
    for row, length in enumerate(lengths):
        ids[row, 0] = CLS
        ids[row, 1:length - 1] = np.arange(token, token + length - 2)
        ids[row, length - 1] = SEP
        mask[row, :length] = 1
        token += length - 2
    return {"input_ids": ids, "input_mask": mask}


def test_cutting_keeps_every_token_in_order_and_frames_each_piece():
    rows = chunk_rows([32, 20])
    cut = cut_chunk_rows(rows, 16, 4, CLS, SEP)
    # 30 body tokens a row, pieces of 14: two pieces a row, the last 2 tokens of a full row dropped.
    assert cut["input_ids"].shape == (4, 16) and cut["masked_lm_ids"].shape == (4, 4)
    pieces = [ids[1:mask.sum() - 1] for ids, mask in zip(cut["input_ids"], cut["input_mask"])]
    assert [len(p) for p in pieces] == [14, 14, 14, 4]
    np.testing.assert_array_equal(np.concatenate(pieces[:2]), np.arange(100, 128))
    np.testing.assert_array_equal(np.concatenate(pieces[2:]), np.arange(130, 148))
    for ids, mask in zip(cut["input_ids"], cut["input_mask"]):
        length = int(mask.sum())
        assert ids[0] == CLS and ids[length - 1] == SEP and not ids[length:].any()
        assert mask[:length].all()
    assert not cut["segment_ids"].any() and not cut["masked_lm_positions"].any()


def test_pieces_past_a_short_rows_end_are_empty_and_mask_nothing():
    cut = cut_chunk_rows(chunk_rows([10]), 8, 2, CLS, SEP)  # 30 // 6 = 5 pieces of 6
    assert cut["input_mask"].sum(axis=1).tolist() == [8, 4, 2, 2, 2]
    tokenizer = WordPieceTokenizer(bundled_vocab_path())
    cut["input_ids"][:, 0], cut["input_ids"][np.arange(5), cut["input_mask"].sum(1) - 1] = (
        tokenizer.cls_id, tokenizer.sep_id)
    mask_arrays(cut, tokenizer, InstanceOptions(sequence_length=8, max_predictions_per_seq=2,
                                                masked_lm_prob=0.25), np.random.default_rng(0))
    assert (cut["masked_lm_ids"][2:] == 0).all()  # nothing to predict in [CLS] [SEP]


def test_stages_follow_progress_and_slots_scale_with_length():
    cfg = small("training.sequence_curriculum=[[0.25, 8], [0.5, 16]]")
    curriculum = SequenceCurriculum(cfg)
    assert [curriculum.length_at(p) for p in (0.0, 0.24, 0.25, 0.49, 0.5, 1.0)] == \
        [8, 8, 16, 16, 32, 32]
    assert [curriculum.slots(n) for n in (8, 16, 32)] == [2, 4, 8]


def test_a_cut_batch_is_masked_anew_at_the_runs_rate_and_seeded_by_step():
    cfg = small()
    with popbert.Trainer.from_config(cfg, None) as trainer:
        full = next(iter(trainer.loader))
    curriculum = SequenceCurriculum(cfg)
    cut = curriculum(full, progress=0.0, step=3)
    assert cut["input_ids"].shape == (8, 16) and cut["masked_lm_ids"].shape == (8, 4)
    assert curriculum(full, 0.9, 3)["input_ids"].shape == (4, 32)  # past the stage: as given
    again = curriculum(full, 0.0, 3)
    for key in cut:
        torch.testing.assert_close(cut[key], again[key], rtol=0, atol=0)
    assert not torch.equal(curriculum(full, 0.0, 4)["masked_lm_positions"],
                           cut["masked_lm_positions"])
    # The same tokens as the full rows, unmasked, cut in order.
    restored = {k: v.numpy().copy() for k, v in cut.items()}
    unmask_rows(restored)
    original = {k: v.numpy().copy() for k, v in full.items()}
    unmask_rows(original)
    np.testing.assert_array_equal(restored["input_ids"][0, 1:15], original["input_ids"][0, 1:15])
    # 25% of each full piece's 14 body tokens, rounded: 4 predictions (the slots' limit).
    per_row = (cut["masked_lm_ids"] != 0).sum(dim=1)
    assert per_row[cut["input_mask"].sum(dim=1) == 16].eq(4).all()


def test_a_run_trains_on_short_rows_then_full_ones_and_resumes_bit_identically(
        tmp_path: Path) -> None:
    cfg = small("training.checkpoint_every=3", "training.keep_checkpoints=0")
    with popbert.Trainer.from_config(cfg, tmp_path / "straight") as trainer:
        widths = record_widths(trainer)
        straight = trainer.train()
    assert widths == [16] * 4 + [32] * 4
    with popbert.Trainer.from_config(
            cfg, tmp_path / "resumed",
            resume=tmp_path / "straight" / "checkpoints" / "step-000003") as trainer:
        resumed = trainer.train()
    ours, theirs = (safetensors.numpy.load_file(str(r.checkpoint / "weights.safetensors"))
                    for r in (resumed, straight))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def record_widths(trainer: popbert.Trainer) -> list[int]:
    widths: list[int] = []
    run = trainer.session.run

    def recorded(batch: Any, micro_batches: int | None = None) -> dict[str, torch.Tensor]:
        widths.append(batch["input_ids"].shape[1])
        return run(batch, micro_batches)

    trainer.session.run = recorded
    return widths


@pytest.mark.parametrize("overrides, blamed", [
    (["model.next_sentence_prediction=true"], "model.next_sentence_prediction"),
    (["data.dynamic_masking=false"], "data.dynamic_masking"),
    (["training.sequence_curriculum=[[0.5, 32]]"], "model.sequence_length"),
    (["training.sequence_curriculum=[[0.5, 16], [0.4, 24]]"], "until increasing"),
    (["training.sequence_curriculum=[[0.5, 4]]"], ">= 8"),
    (["training.sequence_curriculum=[0.5, 16]"], "list of list"),
    (["training.batch_warmup=0.5", "execution.gradient_accumulation=2"],
     "training.batch_warmup"),
])
def test_what_the_curriculum_cannot_do_is_refused_in_one_line(overrides, blamed):
    with pytest.raises(ConfigError, match="training.sequence_curriculum") as error:
        small(*overrides)
    assert blamed in str(error.value) and "\n" not in str(error.value)

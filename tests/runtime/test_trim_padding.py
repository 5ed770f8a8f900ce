"""`execution.trim_padding`: each micro-batch cut to its longest row trains exactly like the padded
one, and the padding past that row is not computed at all.

The reference is the same graph and weights fed the full padded batch. Why they agree: a padded
key's additive mask (-1e4) underflows to an exact zero after the FP32 softmax, padded tokens
never feed real ones (GroupBERT's convolution zeroes them first), and unused MLM slots are
ignored by the loss. What may differ is the GEMMs' summation order over a different shape, a few
FP32 ulps: losses within 1e-6 relative, weights after three AdamW steps within 1e-5 of each
tensor's largest value (measured: 1e-7 and 4e-7). The negative control cuts one real token too
many and moves the loss by more than 1e-3; a run on the padded batch with the static graph (no
symbolic axis) agrees too, so the dynamic graph itself changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)

from popbert.builders.bert import PREDICTIONS, SEQUENCE, build_bert
from popbert.config import RunConfig
from popbert.errors import ConfigError
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.inputs import PaddingTrimmer, input_specs
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

LOSS_REL, WEIGHT_REL = 1e-6, 1e-5
STEPS = 3


def short_rows(config, width: int, batch_size: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """A padded batch of `config.sequence_length` columns whose rows are at most `width` long
    and use at most half the MLM slots: trimming has something to cut on both axes."""
    short = padded_batch(small_config(**{**_overrides(config), "sequence_length": width,
                                         "max_predictions_per_seq":
                                             config.max_predictions_per_seq // 2}),
                         batch_size, seed)
    seq, preds = config.sequence_length, config.max_predictions_per_seq
    batch = {}
    for name, value in short.items():
        if value.ndim == 2:
            full = seq if value.shape[1] == width else preds
            padded = np.zeros((value.shape[0], full), value.dtype)
            padded[:, :value.shape[1]] = value
            value = padded
        batch[name] = value
    return batch


def _overrides(config) -> dict:
    return {k: getattr(config, k) for k in ("architecture", "vocab_size", "hidden_size",
                                             "num_layers", "num_heads", "intermediate_size")}


def train(config, batch, *, dynamic: bool, trim: bool, trimmer=None):
    torch.manual_seed(0)
    graph = build_bert(config, seed=3, dynamic_sequence=dynamic)
    session = TrainingSession(
        graph.model(), graph.loss,
        lambda named: AdamW(param_groups_by_name(named, weight_decay=0.01), lr=1e-3),
        SessionOptions(trim_padding=trim))
    if trimmer is not None:
        session._trim = trimmer(session)
    losses = [float(session.run(batch)["loss"][0]) for _ in range(STEPS)]
    return losses, {k: v.detach().clone() for k, v in session.weights().items()}


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_trimmed_micro_batches_train_like_padded_ones(architecture):
    config = small_config(architecture=architecture, sequence_length=32,
                          max_predictions_per_seq=8)
    batch = short_rows(config, width=16)
    padded_losses, padded = train(config, batch, dynamic=True, trim=False)
    trimmed_losses, trimmed = train(config, batch, dynamic=True, trim=True)
    static_losses, _ = train(config, batch, dynamic=False, trim=False)
    np.testing.assert_allclose(trimmed_losses, padded_losses, rtol=LOSS_REL)
    np.testing.assert_allclose(static_losses, padded_losses, rtol=LOSS_REL)
    assert padded_losses[-1] < padded_losses[0]  # the steps did train
    for name, value in padded.items():
        scale = float(value.abs().max()) or 1.0
        assert float((trimmed[name] - value).abs().max()) <= WEIGHT_REL * scale, name


def test_cutting_a_real_token_is_caught():
    """Negative control: a trimmer that cuts one column short of the longest row."""
    config = small_config(sequence_length=32, max_predictions_per_seq=8)
    batch = short_rows(config, width=16)
    batch["input_mask"][:, :16] = 1  # every row 16 long: the last real column is 15
    np.minimum(batch["masked_lm_positions"], 13, out=batch["masked_lm_positions"])
    padded_losses, _ = train(config, batch, dynamic=True, trim=False)

    def one_short(session):
        trimmer = PaddingTrimmer(session.inputs.specs, multiple=1)
        trimmer._width = lambda marks, full=trimmer._width: full(marks) - 1
        return trimmer

    cut_losses, _ = train(config, batch, dynamic=True, trim=True, trimmer=one_short)
    assert abs(cut_losses[0] - padded_losses[0]) > 1e-3


def test_trimmer_widths():
    config = small_config(sequence_length=32, max_predictions_per_seq=8)
    graph = build_bert(config, zeros=True, dynamic_sequence=True)
    specs = input_specs(graph.model(), list(graph.inputs))
    assert {s.name: s.dims[1] for s in specs if s.dims and len(s.dims) > 1} == {
        "input_ids": SEQUENCE, "segment_ids": SEQUENCE, "input_mask": SEQUENCE,
        "masked_lm_positions": PREDICTIONS, "masked_lm_ids": PREDICTIONS}
    batch = {k: torch.as_tensor(v) for k, v in short_rows(config, width=16).items()}
    batch["input_mask"][:, 9:] = 0
    batch["input_mask"][2, :11] = 1  # longest row: 11 tokens -> 16 (a multiple of 8)
    batch["masked_lm_ids"][:, 3:] = 0
    out = PaddingTrimmer(specs)(batch)
    assert out["input_ids"].shape == out["input_mask"].shape == (4, 16)
    assert out["masked_lm_positions"].shape == out["masked_lm_ids"].shape == (4, 8)
    assert out["next_sentence_labels"].shape == (4,)
    assert PaddingTrimmer(specs, multiple=1)(batch)["input_ids"].shape == (4, 11)
    full = dict(batch, input_mask=torch.ones_like(batch["input_mask"]))
    assert PaddingTrimmer(specs)(full)["input_ids"].shape == (4, 32)


def test_a_static_graph_is_refused():
    graph = build_bert(small_config(), zeros=True)
    with pytest.raises(ValueError, match="symbolic sequence axis"):
        PaddingTrimmer(input_specs(graph.model(), list(graph.inputs)))


@pytest.mark.parametrize("overrides, key", [
    ({"model.packed": True, "model.max_sequences_per_pack": 3}, "model.packed"),
    ({"model.dialect": "popart"}, "model.dialect"),
    ({"finetune.task": "squad"}, "finetune.task"),
])
def test_config_refuses_what_cannot_be_trimmed(overrides, key):
    cfg = RunConfig()
    cfg.execution.trim_padding = True
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match="execution.trim_padding") as error:
        cfg.validate()
    assert key in str(error.value)

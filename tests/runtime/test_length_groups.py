"""`execution.trim_padding` in groups of similar length (`popbert.runtime.groups`): a micro-batch
whose rows differ in length runs as several calls, each cut to its own longest row, and trains
exactly like the padded micro-batch.

The reference is the same graph and weights fed the whole padded micro-batch in one call. Each
group's loss is weighted by its share of the rows (classification, regression) or of the
labelled tokens (token classification), so the loss and every weight's gradient are the padded
pass's: 1e-5 for the loss and 1e-4 of each tensor's largest gradient (only the GEMMs' summation
order differs; measured about 1e-7). The grouped run accumulates every embedding table's
gradient row by row (`popbert.lowering.embedding`), the reference takes dense ones. The negative
control weights the groups by rows where the loss is a mean over tokens, and misses by more than
1e-4 (8e-4 measured).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from bert_helpers import one_thread, small_config  # noqa: F401 (one_thread: autouse)

import popbert.lowering.embedding as embedding
import popbert.runtime.groups as groups
import popbert.tasks  # noqa: F401 (registers the task heads build_bert reads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import TaskConfig
from popbert.graph.annotations import LOSS_MEAN_KEY, LossMean, loss_mean, strip_annotations
from popbert.runtime.groups import length_groups, text_lengths
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

LENGTHS = [31, 6, 12, 29, 7, 18, 5, 30]  # two long rows, short ones and one between


def test_groups_cover_every_row_once_sorted_and_cheapest() -> None:
    """Every index once, each run sorted by length, and the cost the least of every way to cut
    the sorted lengths into runs (checked by trying them all)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 130, size=9)
        cost = int(rng.integers(0, 400))
        runs = length_groups(lengths, cost)
        assert sorted(np.concatenate(runs).tolist()) == list(range(len(lengths)))
        widths = [-(-int(lengths[r].max()) // 8) * 8 for r in runs]
        assert all(a <= b for a, b in zip(widths, widths[1:]))
        ours = sum(len(r) * w + cost for r, w in zip(runs, widths))
        ordered = np.sort(-(-lengths // 8) * 8)
        best = min(sum((b - a) * ordered[b - 1] + cost for a, b in zip((0, *cuts),
                                                                        (*cuts, len(ordered))))
                   for k in range(len(ordered))
                   for cuts in itertools.combinations(range(1, len(ordered)), k))
        assert ours == best
    assert len(length_groups([5, 9, 120], call_cost=10**6)) == 1
    assert len(length_groups([5, 9, 120], call_cost=0)) == 3


def test_a_row_length_is_one_past_its_last_real_token() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert text_lengths(mask).tolist() == [2, 3, 0]


def batch(task: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of LENGTHS real tokens padded to 32; token labels on some tokens only, one row with
    none (its group may score nothing)."""
    rng = np.random.default_rng(seed)
    rows, width = len(LENGTHS), 32
    ids, mask = np.zeros((rows, width), np.int64), np.zeros((rows, width), np.int64)
    for row, length in enumerate(LENGTHS):
        ids[row, :length] = rng.integers(5, 300, length)
        mask[row, :length] = 1
    arrays = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask}
    if task == "token-classification":
        labels = np.where(mask == 1, rng.integers(0, 3, (rows, width)), -100)
        labels[:, 0] = -100
        labels[rng.random((rows, width)) < 0.3] = -100
        labels[6] = -100  # the shortest row scores nothing
        arrays["labels"] = labels
    elif task == "regression":
        arrays["labels"] = rng.normal(size=rows).astype(np.float32)
    else:
        arrays["labels"] = rng.integers(0, 3, rows)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


FAMILIES = {"bert": {}, "groupbert": {"architecture": "groupbert"},
            "modernbert": {"architecture": "modernbert", "next_sentence_prediction": False}}


def model(task: str, family: str = "bert"):
    head = {"classification": TaskConfig(name="classification", num_labels=3),
            "regression": TaskConfig(name="classification", num_labels=1),
            "token-classification": TaskConfig(name="token-classification", num_labels=3,
                                               labels=["O", "B-X", "I-X"])}[task]
    return build_bert(small_config(task=head, **FAMILIES[family]), task=head.name, seed=5,
                      dynamic_sequence=True).model()


def step(proto, micro: dict[str, torch.Tensor], trim: bool
         ) -> tuple[TrainingSession, dict[str, float], dict[str, torch.Tensor]]:
    session = TrainingSession(proto, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0.0),
                              SessionOptions(trim_padding=trim))
    out = session.train_step([{k: v for k, v in micro.items() if k in session.input_names}])
    grads = {n: p.grad.clone() for n, p in session.named_parameters if p.grad is not None}
    return session, {k: float(v) for k, v in out.items()}, grads


@pytest.mark.parametrize("task,family", [("classification", "bert"), ("regression", "bert"),
                                         ("token-classification", "bert"),
                                         ("classification", "groupbert"),
                                         ("token-classification", "modernbert")])
def test_groups_train_like_the_padded_micro_batch(task: str, family: str, monkeypatch) -> None:
    monkeypatch.setattr(groups, "CALL_COST_TOKENS", 0)  # every width its own group
    micro = batch(task)
    assert len(length_groups(text_lengths(micro["input_mask"]))) >= 3
    proto = model(task, family)
    monkeypatch.setattr(embedding, "SPARSE", False)  # the reference: dense table gradients
    _, padded, padded_grads = step(proto, micro, trim=False)
    monkeypatch.setattr(embedding, "SPARSE", True)  # the groups: every table's rows accumulated
    monkeypatch.setattr(embedding, "SPARSE_MIN_ROWS", 1)
    session, grouped, grouped_grads = step(proto, micro, trim=True)
    assert session._groups is not None
    assert all(g.layout == torch.strided for g in grouped_grads.values())
    assert padded.keys() == grouped.keys() and "loss" in padded
    for name in padded:  # the loss, and the accuracy (a mean over the same units)
        assert abs(grouped[name] - padded[name]) <= 1e-5, name
    assert padded_grads.keys() == grouped_grads.keys()
    for name, grad in padded_grads.items():
        assert (grouped_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name


def test_weighting_by_rows_where_the_mean_is_over_tokens_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(groups, "CALL_COST_TOKENS", 0)
    micro = batch("token-classification")
    proto = model("token-classification")
    _, padded, _ = step(proto, micro, trim=False)
    del proto.metadata_props[:]
    proto.metadata_props.add(key=LOSS_MEAN_KEY, value=LossMean().text())
    _, wrong, _ = step(proto, micro, trim=True)
    assert abs(wrong["loss"] - padded["loss"]) > 1e-4  # 10x the tolerance; measured 8e-4


def test_the_graph_says_what_its_loss_is_the_mean_over() -> None:
    assert loss_mean(model("classification")) == LossMean()
    assert loss_mean(model("token-classification")) == LossMean("labels", -100)
    head = TaskConfig(name="classification", num_labels=3)
    inference = build_bert(small_config(task=head), task="classification",
                           with_loss=False).model()
    assert loss_mean(inference) is None  # no loss, nothing said
    assert loss_mean(strip_annotations(model("classification"))) is None  # exports drop it

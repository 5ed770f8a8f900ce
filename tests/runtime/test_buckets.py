"""Inference without the padding (`popbert.runtime.buckets`): a fine-tuned model's evaluation
(`popbert.train.finetune.infer`) runs rows longest first, each batch cut to its longest row,
and gives what one padded batch gives.

The reference is the same graph, the same weights, every row in one batch at the full length.
Only the GEMMs' shapes differ, so the kernels may sum in another order: outputs to 1e-5 of
their largest value. Per-token outputs at masked positions hold the task's fill
(`Task.per_token_outputs`), which no decoding reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bert_helpers import one_thread, small_config  # noqa: F401 (one_thread: autouse)

import popbert.tasks  # noqa: F401 (registers the task heads build_bert reads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import TaskConfig
from popbert.runtime.buckets import run_by_length
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import InferenceSession
from popbert.tasks import task_named
from popbert.train.finetune import infer

HEADS = {"classification": TaskConfig(name="classification", num_labels=3),
         "token-classification": TaskConfig(name="token-classification", num_labels=5),
         "squad": TaskConfig(name="squad")}
FAMILIES = {"bert": {}, "groupbert": {"architecture": "groupbert"},
            "modernbert": {"architecture": "modernbert", "next_sentence_prediction": False}}
LENGTHS = (9, 32, 5, 20, 13, 32, 2)


def rows(seed: int = 0) -> dict[str, np.ndarray]:
    """Seven rows padded to 32, of mixed real lengths, out of length order."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 300, (len(LENGTHS), 32))
    mask = np.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return {"input_ids": ids * mask, "segment_ids": np.zeros_like(ids), "input_mask": mask}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("task", sorted(HEADS))
def test_evaluation_cut_to_each_batch_gives_the_padded_batchs_outputs(task: str,
                                                                     family: str) -> None:
    config = small_config(task=HEADS[task], **FAMILIES[family])
    torch.manual_seed(0)
    graph = build_bert(config, task=task, with_loss=False)
    padded = InferenceSession(graph.model(), SessionOptions())
    weights = padded.weights()
    arrays = rows()
    reference = {k: v.float().numpy() for k, v in padded.run(
        {k: torch.from_numpy(v) for k, v in arrays.items()}).items()}

    ours = infer(config, task, weights, arrays, batch_size=3, device="cpu")

    # evaluation leaves out what is fetched only on request (an embedding's token states)
    assert set(ours) == set(reference) - set(task_named(task).on_request_outputs)
    masked = arrays["input_mask"] == 0
    fills = task_named(task).per_token_outputs
    for name, value in reference.items():
        if name not in ours:
            continue
        assert ours[name].shape == value.shape, name
        if name in fills:  # the masked positions were never a row's own
            assert np.all(ours[name][masked] == fills[name]), name
            value = value.copy()
            value[masked] = fills[name]
        scale = np.abs(value).max()
        assert np.abs(ours[name] - value).max() <= 1e-5 * scale, name


def test_rows_run_longest_first_each_batch_cut_to_its_longest() -> None:
    arrays = rows()
    seen: list[tuple[int, ...]] = []

    def run_batch(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(tuple(feeds["input_mask"].sum(axis=1)))
        assert feeds["input_mask"].shape[1] == max(seen[-1])  # cut to its longest row
        assert set(feeds) == {"input_ids", "input_mask"}  # only the inputs named
        return {"length": feeds["input_mask"].sum(axis=1).astype(np.float32),
                "per_token": feeds["input_ids"].astype(np.float32)}

    result, done = run_by_length(run_batch, arrays, 3, inputs=("input_ids", "input_mask"),
                                 per_token={"per_token": -1.0})
    assert seen == [(32, 32, 20), (13, 9, 5), (2,)]  # ties in input order
    assert done.batches == 3 and done.computed == 3 * 32 + 3 * 13 + 2
    np.testing.assert_array_equal(result["length"], LENGTHS)  # back in the rows' order
    expected = np.where(arrays["input_mask"] == 1, arrays["input_ids"], -1.0)
    np.testing.assert_array_equal(result["per_token"], expected)


def test_a_fixed_batch_gets_its_rows_and_a_fixed_length_every_position() -> None:
    widths: list[tuple[int, int]] = []

    def run_batch(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        widths.append(feeds["input_mask"].shape)
        return {"length": feeds["input_mask"].sum(axis=1).astype(np.float32)}

    result, _ = run_by_length(run_batch, rows(), 16, inputs=("input_mask",), bucket=False,
                              cut=False, fixed_batch=4)
    assert widths == [(4, 32), (4, 32)]  # the last run filled with copies of its last row
    np.testing.assert_array_equal(result["length"], LENGTHS)

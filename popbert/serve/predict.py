"""Answer SQuAD-style questions with an exported model in ONNX Runtime alone (no torch).

`popbert predict squad --model squad.onnx --data questions.json --output predictions.json`
reads the model's `popbert.*` metadata (vocabulary, lowercasing, window sizes; written by
`popbert.io.export.task_metadata`), cuts each context into overlapping windows, runs ONNX Runtime
and picks the best span over all windows.

Reading SQuAD files, windows and span decoding are `popbert.data.squad`, the same code that
fine-tuning builds its features and predictions with, so serving cannot drift from training.
This module adds only what serving needs: loading the ONNX model, reading its metadata and
running it in batches. Its imports (numpy, tokenizers, onnxruntime, the torch-free
`popbert.data.squad` and `popbert.data.tokenization`) must never pull in torch.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from popbert.data.squad import (
    Candidate,
    Question,
    Window,
    WindowOptions,
    build_windows,
    decode_answers,
    read_squad,
    window_arrays,
    write_predictions,
)
from popbert.data.tokenization import make_tokenizer, parse_vocab
from popbert.errors import UsageError
from popbert.graph.annotations import METADATA_PREFIX

log = logging.getLogger(__name__)

# Prefix of the ONNX metadata keys popbert writes (`popbert.io.export` imports it from here, so
# writer and reader agree on one spelling, and serving needs no torch to know it).


class SquadPredictor:
    """An exported `squad` model in ONNX Runtime, with the tokenizer its metadata describes."""

    def __init__(self, model: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        model = Path(model)
        if not model.is_file():
            raise UsageError(f"--model: file not found: {model}")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(model), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as error:  # ORT's own exception types: report, no traceback
            raise UsageError(f"--model: {model}: ONNX Runtime cannot load it "
                             f"({' '.join(str(error).split())[:200]})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get(f"{METADATA_PREFIX}task") != "squad":
            raise UsageError(f"--model: {model} is not a popbert squad export (export it with "
                             "`popbert export --task squad` from a fine-tuned checkpoint)")
        for key in ("vocab", "doc_stride", "max_query_length"):
            if f"{METADATA_PREFIX}{key}" not in meta:
                raise UsageError(f"--model: {model}: metadata {METADATA_PREFIX}{key} missing")
        self.vocab = parse_vocab(meta[f"{METADATA_PREFIX}vocab"],
                                 f"--model: {model}: metadata {METADATA_PREFIX}vocab")
        self.lowercase = bool(json.loads(meta.get(f"{METADATA_PREFIX}lowercase", "true")))
        self.tokenizer = make_tokenizer(self.vocab, self.lowercase)
        shape = self.session.get_inputs()[0].shape
        self.batch_size = shape[0] if isinstance(shape[0], int) else None
        self.sequence_length = int(shape[1])
        self.options = WindowOptions(self.sequence_length,
                                     int(json.loads(meta[f"{METADATA_PREFIX}doc_stride"])),
                                     int(json.loads(meta[f"{METADATA_PREFIX}max_query_length"])))
        self.output_names = [o.name for o in self.session.get_outputs()]

    def logits(self, windows: Sequence[Window], batch_size: int = 16
               ) -> tuple[np.ndarray, np.ndarray]:
        """Start and end logits [N, S] for `windows`, in batches (padded to a fixed batch)."""
        from tqdm import tqdm

        step = self.batch_size or batch_size
        starts, ends = [], []
        for first in tqdm(range(0, len(windows), step), desc="predict", unit="batch",
                          total=math.ceil(len(windows) / step), disable=len(windows) <= step):
            chunk = list(windows[first:first + step])
            real = len(chunk)
            if self.batch_size is not None:
                chunk += [chunk[-1]] * (self.batch_size - real)
            out = dict(zip(self.output_names, self.session.run(None, window_arrays(chunk))))
            starts.append(np.asarray(out["start_logits"], np.float32)[:real])
            ends.append(np.asarray(out["end_logits"], np.float32)[:real])
        return np.concatenate(starts), np.concatenate(ends)

    def predict(self, questions: Sequence[Question], n_best_size: int = 20,
                max_answer_length: int = 30, batch_size: int = 16
                ) -> tuple[dict[str, str], dict[str, list[Candidate]]]:
        """Best answer and n-best list per question id, windowed with the model's options."""
        windows = build_windows(questions, self.tokenizer, self.vocab, self.options)
        start, end = self.logits(windows, batch_size)
        return decode_answers(questions, windows, start, end, n_best_size, max_answer_length)


def predict_squad(model: Path, data: Path, output: Path, n_best_size: int = 20,
                  max_answer_length: int = 30, batch_size: int = 16,
                  threads: int | None = None) -> dict[str, str]:
    """`popbert predict squad`: answer every question of `data`, write `output` (+ n-best)."""
    predictor = SquadPredictor(model, threads)
    questions, _ = read_squad(data)
    predictions, nbest = predictor.predict(questions, n_best_size, max_answer_length, batch_size)
    write_predictions(output, predictions, nbest)
    log.info("answered %d questions with %s: %s", len(predictions), model, output)
    return predictions


__all__ = ["SquadPredictor", "predict_squad"]

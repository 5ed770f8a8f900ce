"""Serve exported squad and classification models in ONNX Runtime, or OpenVINO for an IR
directory (`popbert export --runtime openvino`), alone (no torch).

`popbert predict squad|classify` reads the model's `popbert.*` metadata, encodes the inputs with
the same `popbert.data` code fine-tuning uses (so serving cannot drift from training) and runs
ONNX Runtime in batches. Its imports must never pull in torch. How: docs/design.md, section
"popbert.serve.predict".
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.data.classification import (
    ClassificationData,
    classification_metrics,
    encode_classification_counted,
    label_ids,
    label_scores,
    read_classification_file,
    regression_metrics,
)
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
from popbert.data.tokenization import tokenizer_from_text
from popbert.errors import UsageError, one_line
from popbert.graph.annotations import METADATA_PREFIX
from popbert.rules import PER_MACHINE
from popbert.runtime.buckets import run_by_length
from popbert.serve.openvino_ir import is_ir
from popbert.textfile import read_text

log = logging.getLogger(__name__)

@dataclass
class PredictStats:
    """What one `popbert predict` computed and cut; `ExportedModel.run` and the predictors add
    to it, `predict_squad`/`predict_classify` time the whole and log `describe()`.

    `tokens` are the real (unmasked) tokens fed, `computed` the token positions ONNX Runtime
    ran (each batch's rows times its width, a fixed-batch export's filler rows included), so
    `padding_share` is the part of the work spent on padding.
    """

    examples: int = 0  # questions (SQuAD) or rows (classification) asked about
    rows: int = 0  # model rows: SQuAD windows, classification rows
    batches: int = 0
    tokens: int = 0
    computed: int = 0
    model_seconds: float = 0.0  # in ONNX Runtime's session.run only
    seconds: float = 0.0  # the whole predict: read, tokenize, run, decode (not load, not write)
    sequence_length: int = 0
    bucketed: bool = False  # rows ran longest first
    cut: bool = False  # each batch cut to its longest row (a symbolic sequence axis)
    truncated: int | None = None  # classification: rows truncated to fit
    multi_window: int | None = None  # SQuAD: questions whose context took more than one window
    query_truncated: int | None = None  # SQuAD: questions cut to max_query_length
    runtime: str = "ONNX Runtime"  # or OpenVINO, for an IR
    # Behind `popbert serve`'s batcher: when these stats began (the request's inputs about to be
    # encoded), when its first rows reached the batcher, and how long they waited there for a
    # model run (time.monotonic() seconds; `model_seconds` is then from their first run's start
    # to their last's end).
    began: float = field(default_factory=time.monotonic)
    handed_over: float | None = None
    queue_seconds: float = 0.0

    @property
    def padding_share(self) -> float:
        return (self.computed - self.tokens) / self.computed if self.computed else 0.0

    def summary(self) -> dict[str, float | int]:
        """The figures as JSON fields (the cut counts of the task that was run)."""
        out: dict[str, float | int] = {
            "batches": self.batches,
            "padding_share": round(self.padding_share, 4),
            "examples_per_second": round(self.examples / self.seconds, 1) if self.seconds else 0.0,
            "model_rows_per_second": (round(self.rows / self.model_seconds, 1)
                                      if self.model_seconds else 0.0)}
        for key in ("truncated", "multi_window", "query_truncated"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def describe(self, examples: str = "rows", rows: str = "rows") -> str:
        """One log line: throughput, batches, padding and what was cut."""
        per_second = self.summary()
        counted = f"{self.examples} {examples}"
        if rows != examples:
            counted += f" ({self.rows} {rows})"
        if self.cut:
            shape = (f"{'sorted longest first' if self.bucketed else 'in input order'}, "
                     "each batch cut to its longest row")
        else:
            shape = f"every row padded to the export's length, {self.sequence_length}"
        batches = f"{self.batches} batch" + ("" if self.batches == 1 else "es")
        text = (f"{counted} in {batches}, {self.seconds:.2f} s: "
                f"{per_second['examples_per_second']} {examples}/s end to end (read, tokenize, "
                f"run, decode), {per_second['model_rows_per_second']} {rows}/s in {self.runtime}; "
                f"padding {100 * self.padding_share:.1f}% of {self.computed} computed tokens "
                f"({shape})")
        if self.truncated is not None:
            text += f"; {self.truncated} truncated to {self.sequence_length} tokens"
        if self.multi_window is not None:
            text += (f"; {self.multi_window} needed more than one window, "
                     f"{self.query_truncated} had their question cut to max_query_length")
        return text


def read_onnx(model: Path, load_external_data: bool = True) -> Any:
    """The ONNX model at `model`; a one-line error naming it if it is not one."""
    import onnx

    try:
        return onnx.load(str(model), load_external_data=load_external_data)
    except Exception as error:  # a protobuf DecodeError, an OSError: not an ONNX file
        raise UsageError(f"--model: {model}: not an ONNX model ({one_line(error, 200)})"
                         ) from None


def export_task(model: Path) -> str:
    """The task a popbert export was made for (its `popbert.task` metadata), read without
    loading it into a runtime; a one-line error for anything else."""
    model = Path(model)
    if not model.exists():
        raise UsageError(f"--model: file not found: {model}")
    if is_ir(model):
        from popbert.serve.openvino_ir import ir_file, metadata, openvino

        try:
            meta = metadata(openvino().Core().read_model(str(ir_file(model))))
        except Exception as error:  # OpenVINO's own exception types
            raise UsageError(f"--model: {model}: OpenVINO cannot read it "
                             f"({one_line(error, 200)})") from None
    else:
        proto = read_onnx(model, load_external_data=False)
        meta = {prop.key: prop.value for prop in proto.metadata_props}
    task = meta.get(f"{METADATA_PREFIX}task")
    if task is None:
        raise UsageError(f"--model: {model} is not a popbert task export (no "
                         f"{METADATA_PREFIX}task metadata): export it with `popbert export "
                         "--task TASK` from a fine-tuned checkpoint")
    return task


def predictor_class(task: str) -> type[ExportedModel] | None:
    """The predictor the task table names for `task`'s exports (None: the task has none)."""
    from popbert.tasks import TASKS

    entry = TASKS.get(task)
    if entry is None or entry.predictor is None:
        return None
    module, _, name = entry.predictor.partition(":")
    return getattr(importlib.import_module(module), name)


class ExportedModel:
    """A popbert `task` export in ONNX Runtime's CPU provider (an OpenVINO IR in OpenVINO's CPU
    plugin, at the precision it was verified at; with a torch `device`, e.g. a GPU, popbert's
    torch backend on the ONNX graph), with its metadata.

    `batch_size` is the export's fixed batch (None: symbolic); `sequence_length` its fixed
    length, or for a symbolic sequence axis the length it was trained at (metadata
    `popbert.sequence_length`), which serving pads or truncates inputs to.
    """

    def __init__(self, model: Path, task: str, threads: int | None = None,
                 spinning: bool = True, device: str | None = None) -> None:
        model = Path(model)
        if threads is not None and not PER_MACHINE.allows(threads):
            raise UsageError(f"--threads must be {PER_MACHINE.expected}, got {threads}")
        if not model.exists():
            raise UsageError(f"--model: file not found: {model}")
        self.path = model
        if device is not None:  # a GPU: popbert's torch backend runs the ONNX graph
            self._load_torch(model, device)
        elif is_ir(model):  # an OpenVINO IR directory (popbert export --runtime openvino)
            self._load_openvino(model, threads)
        else:
            self._load_onnxruntime(model, threads, spinning)
        if self.meta.get(f"{METADATA_PREFIX}task") != task:
            raise UsageError(f"--model: {model} is not a popbert {task} export (export it with "
                             f"`popbert export --task {task}` from a fine-tuned checkpoint)")
        from popbert.tasks import task_named

        # What `run` puts at a masked position of a per-token output: the task's value.
        self.per_token: Mapping[str, float] = task_named(task).per_token_outputs
        # What a run fetches unless told: every output but the large ones fetched on request.
        self.default_outputs = [name for name in self.output_names
                                if name not in task_named(task).on_request_outputs]
        self.lowercase = bool(json.loads(self.meta.get(f"{METADATA_PREFIX}lowercase", "true")))
        # The vocab.txt or tokenizer.json the model was trained with, stored in its metadata.
        self.text_tokenizer = tokenizer_from_text(
            self.text("vocab"), self.lowercase,
            f"--model: {model}: metadata {METADATA_PREFIX}vocab")
        self.vocab = self.text_tokenizer.roles
        # The inputs the model reads: a family without segments (ModernBERT) has no
        # segment_ids, which the encoders still produce for BERT.
        shape = self.input_shape
        self.batch_size = shape[0] if isinstance(shape[0], int) else None
        self.dynamic_sequence = not isinstance(shape[1], int)
        self.sequence_length = (int(json.loads(self.text("sequence_length")))
                                if self.dynamic_sequence else int(shape[1]))
        if not self.dynamic_sequence:
            log.info("%s has a fixed sequence length of %d: every row is padded to it (an "
                     "export with a symbolic sequence axis cuts each batch to its longest row)",
                     model, self.sequence_length)

    def _load_onnxruntime(self, model: Path, threads: int | None, spinning: bool) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if not spinning:  # a server: idle runtime threads must not spin on the cores that the
            # event loop and the requests' threads need between batches
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(str(model), options,
                                           providers=["CPUExecutionProvider"])
        except Exception as error:  # ORT's own exception types: report, no traceback
            raise UsageError(f"--model: {model}: ONNX Runtime cannot load it "
                             f"({one_line(error, 200)})") from None
        self.runtime = "ONNX Runtime"
        self.meta = session.get_modelmeta().custom_metadata_map
        self.input_names = {i.name for i in session.get_inputs()}
        self.input_shape = session.get_inputs()[0].shape
        self.output_names = [o.name for o in session.get_outputs()]
        self._run = lambda feeds, names: session.run(names, feeds)

    def _load_openvino(self, model: Path, threads: int | None) -> None:
        from popbert.serve.openvino_ir import compile_model, ir_file, metadata, openvino, run

        ov = openvino()
        try:
            network = ov.Core().read_model(str(ir_file(model)))
        except Exception as error:  # OpenVINO's own exception types
            raise UsageError(f"--model: {model}: OpenVINO cannot read it "
                             f"({one_line(error, 200)})") from None
        self.runtime = "OpenVINO"
        self.meta = metadata(network)
        precision = self.meta.get(f"{METADATA_PREFIX}precision", "f32")
        compiled = compile_model(network, precision, threads)
        self.input_names = {i.get_any_name() for i in network.inputs}
        dims = network.inputs[0].get_partial_shape()
        self.input_shape = [d.get_length() if d.is_static else None for d in dims]
        self.output_names = [o.get_any_name() for o in network.outputs]

        def run_once(feeds: Mapping[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray]:
            outputs = run(compiled, feeds)  # one inference, whatever outputs are read
            return [outputs[name] for name in names]

        self._run = run_once

    def _load_torch(self, model: Path, device: str) -> None:
        """The export's ONNX graph lowered by popbert's torch backend onto `device` (`popbert
        serve --device cuda`): the graph ONNX Runtime runs, op for op, at the export's own
        precision. Imports torch, which the CPU runtimes never do."""
        import torch

        from popbert.errors import ConfigError
        from popbert.runtime.devices import available_devices, resolve_device
        from popbert.runtime.options import SessionOptions
        from popbert.runtime.session import InferenceSession

        flag = f"--device {device}"
        if is_ir(model):
            raise UsageError(f"{flag}: {model} is an OpenVINO IR, which runs on the CPU; serve "
                             "an ONNX export (`popbert export` without --runtime) on a GPU")
        proto = read_onnx(model)
        contrib = sorted({node.op_type for node in proto.graph.node
                          if node.domain == "com.microsoft"})
        if contrib:
            raise UsageError(f"{flag}: {model} has ONNX Runtime's own CPU operators "
                             f"({', '.join(contrib)}: an --optimize or --quantize int8 "
                             "export); serve a plain FP32 or FP16 export on a GPU")
        try:
            resolve_device(device)
        except ConfigError:
            raise UsageError(f"{flag}: not a device of this machine, which has "
                             f"{available_devices()}; expected cuda or cuda:N") from None
        session = InferenceSession(proto, SessionOptions(device=device))
        self.runtime = f"torch ({session.device})"
        self.meta = {prop.key: prop.value for prop in proto.metadata_props}
        self.input_names = set(session.input_names)
        self.input_shape = [dim.dim_value if dim.HasField("dim_value") else None
                            for dim in proto.graph.input[0].type.tensor_type.shape.dim]
        self.output_names = list(session.output_names)

        def run(feeds: Mapping[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray]:
            outputs = session.run({name: torch.from_numpy(value)
                                   for name, value in feeds.items()})
            return [outputs[name].float().cpu().numpy() for name in names]

        self._run = run

    # `popbert serve` sets a `popbert.serve.batcher.RowBatcher` here: `run` then hands the rows
    # to it, batched with other requests' rows, instead of running them itself.
    batcher: Any = None

    def forward(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
                ) -> dict[str, np.ndarray]:
        """One run of the model on ready feeds ([B, W] each): the outputs named (default:
        `default_outputs`) by name."""
        names = list(self.default_outputs if outputs is None else outputs)
        return dict(zip(names, self._run(dict(feeds), names)))

    def check_outputs(self, outputs: Sequence[str]) -> None:
        """A one-line error for an output the export does not have (one made before it was
        added, e.g.), naming what to do."""
        missing = [name for name in outputs if name not in self.output_names]
        if missing:
            raise UsageError(f"--model: {self.path} has no {', '.join(missing)} output (its "
                             f"outputs: {', '.join(self.output_names)}); export the checkpoint "
                             "again with this version of popbert")

    def text(self, key: str) -> str:
        """Metadata `popbert.<key>`; a one-line error naming the model if it is missing."""
        value = self.meta.get(f"{METADATA_PREFIX}{key}")
        if value is None:
            raise UsageError(f"--model: {self.path}: metadata {METADATA_PREFIX}{key} missing")
        return value

    def calibration_arrays(self, data: Path) -> dict[str, np.ndarray]:
        """The model rows of the task's file `data` (its `--train` format), encoded as this
        export is served: what static quantization calibrates on."""
        task = self.meta.get(f"{METADATA_PREFIX}task")
        raise UsageError(f"--calibration: a {task} export has no calibration rows")

    def run(self, arrays: Mapping[str, np.ndarray], batch_size: int = 16,
            per_token: Mapping[str, float] | None = None, stats: PredictStats | None = None,
            bucket: bool = True, outputs: Sequence[str] | None = None
            ) -> dict[str, np.ndarray]:
        """The outputs named in `outputs` (default: `default_outputs`) for the rows of `arrays`
        ([N, S] inputs), `batch_size` rows per run (a fixed-batch export runs its own batch,
        the last one padded).

        With a symbolic sequence axis rows run longest first (by `input_mask`, stable; with
        `bucket=False` in input order) and each batch is cut to its longest row; the outputs
        named in `per_token` (default: the task's, `Task.per_token_outputs`; [N, S, ...]) are
        padded back to S and hold the value given at every masked position, so that no row's
        outputs depend on the rows batched with it.
        A fixed sequence axis runs every row at S. Outputs come back in the rows' order.
        `stats`, if given, gets the rows, batches, real and computed tokens and ONNX Runtime's
        time added.
        """
        per_token = self.per_token if per_token is None else per_token
        if outputs is not None:
            self.check_outputs(outputs)
        if self.batcher is not None:
            return self.batcher.run(arrays, batch_size, per_token, stats, bucket, outputs)
        if batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
        bucketed = self.dynamic_sequence and bucket
        result, done = run_by_length(lambda feeds: self.forward(feeds, outputs), arrays,
                                     batch_size, inputs=self.input_names,
                                     per_token=per_token, bucket=bucketed,
                                     cut=self.dynamic_sequence, fixed_batch=self.batch_size)
        if stats is not None:
            stats.rows += len(arrays["input_mask"])
            stats.batches += done.batches
            stats.tokens += int(np.asarray(arrays["input_mask"]).sum())
            stats.computed += done.computed
            stats.model_seconds += done.seconds
            stats.runtime = self.runtime
            stats.sequence_length = np.asarray(arrays["input_ids"]).shape[1]
            stats.bucketed = bucketed
            stats.cut = self.dynamic_sequence
        return result


class SquadPredictor(ExportedModel):
    """An exported `squad` model in ONNX Runtime, with the tokenizer its metadata describes."""

    def __init__(self, model: Path, threads: int | None = None, spinning: bool = True,
                 device: str | None = None) -> None:
        super().__init__(model, "squad", threads, spinning, device)
        self.tokenizer = self.text_tokenizer.backend
        self.options = WindowOptions(self.sequence_length,
                                     int(json.loads(self.text("doc_stride"))),
                                     int(json.loads(self.text("max_query_length"))))

    def calibration_arrays(self, data: Path) -> dict[str, np.ndarray]:
        """The windows of the questions of the SQuAD file `data`."""
        questions, _ = read_squad(data)
        return window_arrays(build_windows(questions, self.tokenizer, self.vocab, self.options))

    def logits(self, windows: Sequence[Window], batch_size: int = 16,
               stats: PredictStats | None = None, bucket: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
        """Start and end logits [N, S] for `windows`, in batches of `batch_size` windows."""
        out = self.run(window_arrays(windows), batch_size, stats=stats, bucket=bucket)
        return out["start_logits"], out["end_logits"]

    def predict(self, questions: Sequence[Question], n_best_size: int = 20,
                max_answer_length: int = 30, batch_size: int = 16,
                stats: PredictStats | None = None
                ) -> tuple[dict[str, str], dict[str, list[Candidate]]]:
        """Best answer and n-best list per question id, windowed with the model's options;
        `stats`, if given, also gets the questions and what windowing cut (`window_cuts`)."""
        windows = build_windows(questions, self.tokenizer, self.vocab, self.options)
        start, end = self.logits(windows, batch_size, stats)
        if stats is not None:
            stats.examples += len(questions)
            multi, cut = window_cuts(windows)
            stats.multi_window = (stats.multi_window or 0) + multi
            stats.query_truncated = (stats.query_truncated or 0) + cut
        return decode_answers(questions, windows, start, end, n_best_size, max_answer_length)


def window_cuts(windows: Sequence[Window]) -> tuple[int, int]:
    """(questions whose context took more than one window, questions cut to the model's
    max_query_length) among the questions of `windows`."""
    per_question = Counter(w.question_index for w in windows)
    cut = {w.question_index for w in windows if w.query_truncated}
    return sum(1 for n in per_question.values() if n > 1), len(cut)


def read_texts(path: Path, text_column: str | None = None, pair_column: str | None = None,
               label_column: str | None = None) -> ClassificationData:
    """Rows to classify: a TSV/CSV/JSONL file as fine-tuning reads it (gold labels from
    `label_column`, or from a `label` column where the file has one), or a `.txt` file with one
    text per non-empty line. A column named here that the file lacks is one line, never
    ignored (a .txt file has no columns)."""
    path = Path(path)
    if path.suffix.lower() != ".txt":
        data = read_classification_file(path, text_column, pair_column,
                                        label_column or "label", require_labels=False)
        if label_column is not None and data.labels is None:
            raise UsageError(f"--label-column {label_column}: {path} has no such column; name "
                             "the file's label column, or leave the flag out to predict only")
        return data
    named = [f"{flag} {value}" for flag, value in (("--text-column", text_column),
                                                   ("--text-pair-column", pair_column),
                                                   ("--label-column", label_column)) if value]
    if named:
        raise UsageError(f"{named[0]}: {path} is a .txt file of texts, one a line, without "
                         "columns; leave the flag out, or give rows (.tsv, .csv, .jsonl)")
    if not path.is_file():
        raise UsageError(f"--data: file not found: {path}")
    texts, lines = [], []
    text = read_text(path, "a .txt file, one text a line", error=UsageError)
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            texts.append(line.strip())
            lines.append(number)
    if not texts:
        raise UsageError(f"--data: {path}: no text lines")
    return ClassificationData(path, texts, None, None, lines)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) without overflow: e^-|x| never exceeds 1."""
    small = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + small), small / (1.0 + small))


# What a one-output model's score goes through (`model.task.activation`, metadata
# `popbert.activation`): a sentence-transformers CrossEncoder's scores are sigmoid(logit).
ACTIVATIONS = {"sigmoid": sigmoid, "identity": lambda x: x}


class ClassifyPredictor(ExportedModel):
    """An exported `classification` model: texts in, label names and probabilities out; or, for
    a regression model (one output, no labels: `finetune classify --regression`), a score, put
    through the activation its metadata records (an imported CrossEncoder's), as
    `CrossEncoder.predict` does."""

    def __init__(self, model: Path, threads: int | None = None, spinning: bool = True,
                 device: str | None = None) -> None:
        super().__init__(model, "classification", threads, spinning, device)
        outputs = json.loads(self.meta.get(f"{METADATA_PREFIX}num_labels", "null"))
        self.regression = outputs == 1
        self.labels = None if self.regression else [str(x) for x in
                                                    json.loads(self.text("labels"))]
        self.activation = json.loads(self.meta.get(f"{METADATA_PREFIX}activation", "null"))
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise UsageError(f"--model: {model}: metadata {METADATA_PREFIX}activation is "
                             f"{self.activation!r}; expected one of {', '.join(ACTIVATIONS)}")
        self.tokenizer = self.text_tokenizer

    def calibration_arrays(self, data: Path) -> dict[str, np.ndarray]:
        """The rows (texts or pairs) of `data`."""
        arrays, _ = encode_classification_counted(read_texts(data), self.tokenizer,
                                                  self.sequence_length)
        return arrays

    def logits(self, data: ClassificationData, batch_size: int = 16,
               stats: PredictStats | None = None, bucket: bool = True) -> np.ndarray:
        """The head's outputs, [N, num_labels], for the rows of `data`; `stats`, if given,
        also gets the rows and how many were truncated to the model's length."""
        arrays, truncated = encode_classification_counted(data, self.tokenizer,
                                                          self.sequence_length)
        logits = self.run(arrays, batch_size, stats=stats, bucket=bucket)["logits"]
        if stats is not None:
            stats.examples += len(logits)
            stats.truncated = (stats.truncated or 0) + truncated
        return logits

    def scores(self, data: ClassificationData, batch_size: int = 16,
               stats: PredictStats | None = None, bucket: bool = True) -> np.ndarray:
        """A regression model's score, [N], for the rows of `data`: its output, through the
        recorded activation (a CrossEncoder's sigmoid) where there is one."""
        if not self.regression:
            raise UsageError(f"--model: {self.path} is a classifier of {len(self.labels or [])} "
                             "labels, not a regression model (one score)")
        scores = self.logits(data, batch_size, stats, bucket)[:, 0]
        if self.activation is None:
            return scores
        return np.asarray(ACTIVATIONS[self.activation](scores), np.float32)

    def probabilities(self, data: ClassificationData, batch_size: int = 16,
                      stats: PredictStats | None = None, bucket: bool = True) -> np.ndarray:
        """Softmax over the labels, [N, num_labels], for the rows of `data`."""
        if self.regression:
            raise UsageError(f"--model: {self.path} is a regression model (one score), not a "
                             "classifier: it has no label probabilities")
        logits = self.logits(data, batch_size, stats, bucket)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    def predict(self, data: ClassificationData, batch_size: int = 16,
                stats: PredictStats | None = None) -> tuple[list[str], np.ndarray]:
        """(label name, probabilities) of every row of `data`."""
        probabilities = self.probabilities(data, batch_size, stats)
        return [self.labels[i] for i in probabilities.argmax(axis=1)], probabilities


def predict_squad(model: Path, data: Path, output: Path, n_best_size: int = 20,
                  max_answer_length: int = 30, batch_size: int = 16,
                  threads: int | None = None, stats: PredictStats | None = None,
                  device: str | None = None) -> dict[str, str]:
    """`popbert predict squad`: answer every question of `data`, write `output` (+ n-best)
    and log `stats` (filled in if given): throughput, padding and what windowing cut."""
    predictor = SquadPredictor(model, threads, device=device)
    stats = stats if stats is not None else PredictStats()
    started = time.perf_counter()
    questions, _ = read_squad(data)
    predictions, nbest = predictor.predict(questions, n_best_size, max_answer_length, batch_size,
                                           stats)
    stats.seconds += time.perf_counter() - started
    write_predictions(output, predictions, nbest)
    log.info("answered %d questions with %s: %s", len(predictions), model, output)
    log.info("predict: %s", stats.describe("questions", "windows"))
    return predictions


def predict_classify(model: Path, data: Path, output: Path, batch_size: int = 16,
                     threads: int | None = None, text_column: str | None = None,
                     pair_column: str | None = None, label_column: str | None = None,
                     stats: PredictStats | None = None,
                     device: str | None = None) -> dict[str, float] | None:
    """`popbert predict classify`: label every row of `data` and write `output` as JSON lines
    (`line`, `label`, `probabilities` by label, `gold` where the file has labels), and log
    `stats` (filled in if given). Returns accuracy and F1 when the file is labelled (with the
    model's labels) and `stats.summary()`'s figures beside them, else None."""
    predictor = ClassifyPredictor(model, threads, device=device)
    stats = stats if stats is not None else PredictStats()
    started = time.perf_counter()
    rows = read_texts(data, text_column, pair_column, label_column)
    if predictor.regression:
        return _predict_scores(predictor, rows, output, batch_size, stats, started,
                               label_column or "label")
    gold = rows.labels
    # Gold labels the model does not have are refused before any work (nothing is written).
    gold_ids = None if gold is None else label_ids(rows, predictor.labels)
    predicted, probabilities = predictor.predict(rows, batch_size, stats)
    stats.seconds += time.perf_counter() - started
    records = []
    for index, (line, label) in enumerate(zip(rows.lines, predicted)):
        record = {"line": line, "label": label,
                  "probabilities": {name: round(float(p), 6)
                                    for name, p in zip(predictor.labels, probabilities[index])}}
        if gold is not None:
            record["gold"] = gold[index]
        records.append(json.dumps(record) + "\n")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, "".join(records))
    log.info("labelled %d rows of %s with %s: %s", len(records), data, model, output)
    log.info("predict: %s", stats.describe())
    if gold_ids is None:
        return None
    metrics = classification_metrics(probabilities.argmax(axis=1), gold_ids,
                                     len(predictor.labels))
    metrics["examples"] = len(records)
    metrics.update(stats.summary())
    return metrics


def _predict_scores(predictor: ClassifyPredictor, rows: ClassificationData, output: Path,
                    batch_size: int, stats: PredictStats, started: float,
                    label_column: str) -> dict[str, float] | None:
    """`predict classify` with a regression model: each row's score (`line`, `score`, `gold`
    where the file has scores); Pearson, Spearman and the MSE when it has."""
    # Gold scores that are not numbers are refused before any work (nothing is written).
    gold = None if rows.labels is None else label_scores(rows, label_column)
    scores = predictor.scores(rows, batch_size, stats)
    stats.seconds += time.perf_counter() - started
    records = []
    for index, line in enumerate(rows.lines):
        record: dict[str, object] = {"line": line, "score": float(scores[index])}
        if gold is not None:
            record["gold"] = float(gold[index])
        records.append(json.dumps(record) + "\n")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, "".join(records))
    log.info("scored %d rows of %s with %s: %s", len(records), rows.path, predictor.path, output)
    log.info("predict: %s", stats.describe())
    if gold is None:
        return None
    metrics: dict[str, float] = dict(regression_metrics(scores, gold))
    metrics["examples"] = len(records)
    metrics.update(stats.summary())
    return metrics


__all__ = ["ClassifyPredictor", "ExportedModel", "PredictStats", "SquadPredictor",
           "export_task", "predict_classify", "predict_squad", "predictor_class", "read_onnx",
           "read_texts", "window_cuts"]

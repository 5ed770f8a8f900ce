"""A probe beyond ONNX Runtime: popbert's classification export statically quantized to INT8
(QDQ form) and run by OpenVINO's CPU plugin, against popbert's dynamic INT8 export in ONNX
Runtime and `transformers` eager, on the fine-tuned MiniLM topic classifier of
`benchmarks/inference.py`: held-out accuracy, and latency at fixed shapes.

Why: ONNX Runtime's CPU provider leaves 20-45% of a dynamic INT8 call in FP32 kernels it cannot
fuse (`benchmarks/inference_ceiling.py`); OpenVINO fuses bias, GELU, residual and LayerNorm into
its GEMMs but needs activation scales fixed ahead of time (static quantization, calibrated on
real rows). This is a measurement of that route, not a popbert feature: popbert does not depend
on OpenVINO (`pip install openvino` in this environment to run it).

- **static INT8**: `onnxruntime.quantization.quantize_static` on the plain FP32 export, QDQ
  format, per-channel INT8 weights, UINT8 activations with ranges from `--calibration-rows`
  training texts (`--calibration` method; Percentile keeps the 99.999th percentile, MinMax the
  extremes), the attention products and task heads left FP32; scored in ONNX Runtime (which
  emulates the QDQ arithmetic) and in OpenVINO (which runs it in INT8), at OpenVINO's default
  precision (BF16 for what is not INT8, on a CPU with AVX512-BF16) and with FP32 forced;
- **dynamic INT8**: `popbert export --quantize int8`, in ONNX Runtime;
- latency: batch 1 and 32, sequence 128, random ids, `--threads` threads, interleaved in short
  blocks with a pause before each, medians; HF eager is `popbert export-hf` of the same run.
  OpenVINO's file is compiled for the shape timed (both precisions) and for symbolic shapes
  (what serving batches cut to their longest row would need).

    python benchmarks/openvino_probe.py --work-dir runs/inference   # the cached fine-tune
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inference  # noqa: E402  (the fine-tuned classifier, exports, timer)

# The precision hint of each OpenVINO runtime row: the plugin's default (BF16 wherever the CPU
# has AVX512-BF16 or AMX, FP32 elsewhere) and FP32 forced, the precision ONNX Runtime keeps.
PRECISIONS = {"openvino": None, "openvino-f32": "f32"}


class OpenVINOSession:
    """An OpenVINO compiled model behind ONNX Runtime's `run(None, feeds)`, so popbert's
    `ClassifyPredictor` can serve it unchanged."""

    def __init__(self, path: Path, threads: int, shape: list[int] | None = None,
                 precision: str | None = None) -> None:
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(path))
        if shape is not None:
            model.reshape({i.get_any_name(): shape for i in model.inputs})
        config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
                  "PERFORMANCE_HINT": "LATENCY"}
        if precision is not None:  # None: the plugin's default, BF16 on a CPU that has it
            config["INFERENCE_PRECISION_HINT"] = precision
        self.compiled = core.compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.names = [i.get_any_name() for i in model.inputs]

    def run(self, _outputs, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        result = self.request.infer({name: feeds[name] for name in self.names})
        return [np.asarray(result[output]) for output in self.compiled.outputs]


def static_int8(fp32_file: Path, output: Path, arrays: dict[str, np.ndarray], rows: int,
                method: str, seed: int = 0) -> Path:
    """`fp32_file` quantized statically (QDQ) with ranges from `rows` of `arrays`, 16 a batch;
    popbert's metadata kept so `popbert predict`'s code serves it."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    from popbert.export.quantize import HEAD, weight_role

    model = onnx.load(str(fp32_file))
    pick = np.random.default_rng(seed).choice(len(arrays["input_ids"]), rows, replace=False)
    names = [i.name for i in model.graph.input]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{n: arrays[n][pick[i:i + 16]] for n in names}
                                 for i in range(0, rows, 16)])

        def get_next(self):
            return next(self.batches, None)

    kept = [n.name for n in model.graph.node if n.op_type == "Attention" or (
        n.op_type == "MatMul" and weight_role(n.input[1]) == HEAD)]
    quantize_static(str(fp32_file), str(output), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                    nodes_to_exclude=kept, calibrate_method=getattr(CalibrationMethod, method),
                    extra_options={"MatMulConstBOnly": True})
    quantized = onnx.load(str(output))
    del quantized.metadata_props[:]
    quantized.metadata_props.extend(model.metadata_props)
    onnx.save(quantized, str(output))
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True,
                        help="benchmarks/inference.py's work directory (the fine-tune is "
                             "cached there, or made)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calibration", choices=["Percentile", "MinMax", "Entropy"],
                        default="Percentile")
    parser.add_argument("--calibration-rows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=inference.GOAL_THREADS)
    parser.add_argument("--rounds", type=int, default=45)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import openvino  # noqa: F401
    except ImportError:
        sys.exit("openvino_probe.py: OpenVINO is not installed in this environment "
                 "(pip install openvino==2026.4.1)")

    import torch
    import transformers

    from popbert.data.classification import encode_classification_counted
    from popbert.hf.checkpoint import export_hf
    from popbert.serve.predict import ClassifyPredictor, read_texts

    torch.set_num_threads(args.threads)
    run = inference.fine_tuned(argparse.Namespace(sequence_length=128, epochs=args.epochs,
                                                  lr=args.lr, seed=args.seed,
                                                  mix_threads=args.threads), args.work_dir)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{os.getloadavg()[0]:.2f}; {run}", flush=True)
    with tempfile.TemporaryDirectory(prefix="popbert-openvino-") as tmp:
        work = Path(tmp)
        files, _ = inference.classification_exports(run, work,
                                                    ["popbert-fp32", "popbert-int8"])
        reference = ClassifyPredictor(files["popbert-fp32"], args.threads)
        train, test = (read_texts(inference.DATA / f"topic-{part}.jsonl")
                       for part in ("train", "test"))
        arrays, _ = encode_classification_counted(train, reference.tokenizer,
                                                  reference.sequence_length)
        files["static-int8"] = static_int8(files["popbert-fp32"], work / "static-int8.onnx",
                                           arrays, args.calibration_rows, args.calibration)

        print(f"\nHeld-out accuracy, {len(test.texts)} articles ({args.calibration} "
              f"calibration on {args.calibration_rows} training rows):\n")
        print("| variant | runtime | accuracy | labels = FP32's |\n| --- | --- | ---: | ---: |")
        expected = reference.probabilities(test, 32).argmax(axis=1)
        for name, runtime in (("popbert-fp32", "onnxruntime"), ("popbert-int8", "onnxruntime"),
                              ("static-int8", "onnxruntime"), ("static-int8", "openvino"),
                              ("static-int8", "openvino-f32"), ("popbert-fp32", "openvino"),
                              ("popbert-fp32", "openvino-f32")):
            reused = name == "popbert-fp32" and runtime == "onnxruntime"
            predictor = reference if reused else ClassifyPredictor(files[name], args.threads)
            if runtime.startswith("openvino"):
                predictor.session = OpenVINOSession(files[name], args.threads,
                                                    precision=PRECISIONS[runtime])
            got = expected if reused else predictor.probabilities(test, 32).argmax(axis=1)
            accuracy = np.mean([predictor.labels[i] == gold for i, gold in
                                zip(got, test.labels)])
            print(f"| {name} | {runtime} | {100 * accuracy:.2f} | "
                  f"{100 * np.mean(got == expected):.1f}% |", flush=True)

        export_hf(run, work / "hf")
        model = transformers.BertForSequenceClassification.from_pretrained(
            str(work / "hf"), attn_implementation="sdpa").eval()
        print(f"\nLatency, sequence 128, {args.threads} threads (ms per call, speed-up over "
              "HF eager):\n")
        columns = {"popbert-fp32": "popbert FP32 (ORT)",
                   "popbert-int8": "popbert dynamic INT8 (ORT)",
                   "ov-default": "static INT8 (OpenVINO, default precision)",
                   "ov-f32": "static INT8 (OpenVINO, f32 precision)",
                   "ov-dynamic": "static INT8 (OpenVINO, default, symbolic shapes)"}
        print("| batch | HF eager | " + " | ".join(columns.values()) + " |\n| ---: |"
              + " ---: |" * (len(columns) + 1))
        for batch in (1, 32):
            ids = inference.batch(batch, 128, model.config.vocab_size)
            feeds = {"input_ids": ids["ids"], "segment_ids": ids["segments"],
                     "input_mask": ids["mask"]}
            tensors = inference.hf_inputs(ids)

            def eager(tensors=tensors):
                with torch.no_grad():
                    return model(**tensors).logits

            runners = {"hf": eager}
            for name in ("popbert-fp32", "popbert-int8"):
                session = inference.ort_session(files[name], args.threads)
                runners[name] = (lambda s=session, f=feeds: s.run(None, f))
            # Compiled for this shape (what OpenVINO's latency mode is built for) and, as
            # `popbert predict` would need to cut batches to their longest row, for any shape.
            for name, shape, runtime in (("ov-default", [batch, 128], "openvino"),
                                         ("ov-f32", [batch, 128], "openvino-f32"),
                                         ("ov-dynamic", None, "openvino")):
                openvino = OpenVINOSession(files["static-int8"], args.threads, shape,
                                           PRECISIONS[runtime])
                runners[name] = lambda s=openvino, f=feeds: s.run(None, f)
            for run_once in runners.values():
                run_once()
            rounds = args.rounds if batch == 1 else max(6, args.rounds // 5)
            times = inference.time_rotating(runners, rounds)
            ms = {name: statistics.median(values) for name, values in times.items()}
            print(f"| {batch} | {ms['hf']:.1f} | " + " | ".join(
                f"{ms[n]:.1f} ({ms['hf'] / ms[n]:.2f}x)"
                for n in columns) + " |", flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""The Hugging Face Optimum side of benchmarks/inference.py, run with the Optimum environment's
Python (benchmarks/optimum_env.sh); it imports neither popbert nor anything of this repository.

    export   a Hugging Face model directory → Optimum's ONNX export (`ORTModelFor...`,
             export=True), `ORTOptimizer` at each of --levels, and `ORTQuantizer` dynamic INT8
             (`AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=False/True)`)
             of the plain export and of each optimized graph it can quantize; writes a
             JSON manifest of the files written, the versions and what failed
    worker   a `transformers.pipeline("text-classification")` on one
             ORTModelForSequenceClassification file, answering JSON commands on stdin, one
             per line, with one JSON line each on stdout:
             {"cmd": "time"} classifies every text once and returns the seconds it took;
             {"cmd": "labels"} returns the label of every text; {"cmd": "quit"};
             with --runtime openvino the model is optimum-intel's OVModelForSequenceClassification
             (an `export-ov` directory) compiled with --threads threads and one stream
    export-ov  (optimum-intel's environment, `benchmarks/optimum_env.sh --intel`) a Hugging Face
             model directory → optimum-intel's OpenVINO IR (`OVModelFor...`, export=True,
             saved as optimum-intel saves it) and its static INT8 IR by `OVQuantizer` with
             `OVQuantizationConfig()`'s defaults (NNCF under optimum-intel's settings),
             calibrated on --calibration-texts (tokenized by the model's own tokenizer, each
             row at its own length, cut to --max-length) or --calibration-ids (an .npz of
             input_ids / attention_mask / token_type_ids rows); writes a JSON manifest

Optimum's levels: O1 basic graph optimisations; O2 adds the transformer fusions (Attention,
SkipLayerNormalization, BiasGelu, EmbedLayerNormalization); O3 adds the GELU approximation
(FastGelu); O4 is O3 in FP16, which Optimum only offers for GPU (`for_gpu=True`), so it is not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "tokenizer.json",
                   "special_tokens_map.json")


REPLY = sys.stdout


def say(message: dict) -> None:
    REPLY.write(json.dumps(message) + "\n")
    REPLY.flush()


def versions() -> dict[str, str]:
    import importlib.metadata as md

    import onnxruntime

    return {name: md.version(name) for name in ("optimum", "optimum-onnx", "transformers",
                                                "torch", "onnx", "tokenizers")} | {
        "onnxruntime": onnxruntime.__version__, "python": sys.version.split()[0]}


def intel_versions() -> dict[str, str]:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("optimum-intel", "optimum", "openvino", "nncf",
                                                "transformers", "torch", "tokenizers")} | {
        "python": sys.version.split()[0]}


def constant_types(xml: Path) -> dict[str, int]:
    """Element types of an IR's constants (its weights: f32, f16, i8...), counted."""
    from collections import Counter

    import openvino as ov

    model = ov.Core().read_model(str(xml))
    return dict(Counter(op.get_output_element_type(0).get_type_name()
                        for op in model.get_ops() if op.get_type_name() == "Constant"))


def export_ov(args: argparse.Namespace) -> None:
    import nncf
    import numpy as np
    from optimum.intel import (
        OVConfig,
        OVModelForFeatureExtraction,
        OVModelForSequenceClassification,
        OVQuantizationConfig,
        OVQuantizer,
    )
    from transformers import AutoTokenizer

    cls = {"feature-extraction": OVModelForFeatureExtraction,
           "text-classification": OVModelForSequenceClassification}[args.task]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"task": args.task, "source": str(args.model), "versions": intel_versions(),
                      "files": {}, "seconds": {}}

    def record(name: str, directory: Path, started: float) -> None:
        for tokenizer_file in TOKENIZER_FILES:
            if (Path(args.model) / tokenizer_file).is_file():
                shutil.copy(Path(args.model) / tokenizer_file, directory / tokenizer_file)
        xml = directory / "openvino_model.xml"
        manifest["files"][name] = {"dir": str(directory), "file_name": xml.name,
                                   "constants": constant_types(xml)}
        manifest["seconds"][name] = round(time.perf_counter() - started, 2)

    started = time.perf_counter()
    model = cls.from_pretrained(args.model, export=True, compile=False)
    model.save_pretrained(out / "ov-fp32")
    record("ov-fp32", out / "ov-fp32", started)
    names = [i.get_any_name() for i in model.model.inputs]
    if args.calibration_texts:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        texts = json.loads(Path(args.calibration_texts).read_text())[:args.calibration_rows]
        rows = [{k: np.asarray(v, np.int64)[None] for k, v in tokenizer(
            text, truncation=True, max_length=args.max_length).items() if k in names}
            for text in texts]
    else:
        arrays = np.load(args.calibration_ids)
        rows = [{k: arrays[k][i:i + 1].astype(np.int64) for k in names}
                for i in range(min(args.calibration_rows, len(arrays["input_ids"])))]
    started = time.perf_counter()
    quantizer = OVQuantizer.from_pretrained(model)
    qconfig = OVQuantizationConfig()
    quantizer.quantize(calibration_dataset=nncf.Dataset(rows),
                       ov_config=OVConfig(quantization_config=qconfig),
                       save_directory=out / "ov-int8")
    record("ov-int8", out / "ov-int8", started)
    manifest["quantization"] = {"config": "OVQuantizationConfig()", **{
        k: str(v) for k, v in qconfig.to_dict().items() if not k.startswith("_")},
        "calibration_rows": len(rows),
        "calibration": "texts" if args.calibration_texts else "random token ids"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    say(manifest)


def op_counts(path: Path) -> dict[str, int]:
    from collections import Counter

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return dict(sorted(Counter(node.op_type for node in model.graph.node).items()))


def export(args: argparse.Namespace) -> None:
    from optimum.onnxruntime import (
        AutoOptimizationConfig,
        AutoQuantizationConfig,
        ORTModelForFeatureExtraction,
        ORTModelForSequenceClassification,
        ORTOptimizer,
        ORTQuantizer,
    )

    cls = {"feature-extraction": ORTModelForFeatureExtraction,
           "text-classification": ORTModelForSequenceClassification}[args.task]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"task": args.task, "source": str(args.model), "versions": versions(),
                      "levels": args.levels, "int8": args.int8, "files": {}, "seconds": {}}

    def record(name: str, directory: Path, file_name: str, started: float) -> None:
        for tokenizer_file in TOKENIZER_FILES:  # each directory loads on its own in a pipeline
            if (Path(args.model) / tokenizer_file).is_file():
                shutil.copy(Path(args.model) / tokenizer_file, directory / tokenizer_file)
        manifest["files"][name] = {"dir": str(directory), "file_name": file_name,
                                   "ops": op_counts(directory / file_name)}
        manifest["seconds"][name] = round(time.perf_counter() - started, 2)

    started = time.perf_counter()
    model = cls.from_pretrained(args.model, export=True)
    model.save_pretrained(out / "plain")
    record("plain", out / "plain", "model.onnx", started)
    for level in args.levels:
        started = time.perf_counter()
        optimizer = ORTOptimizer.from_pretrained(model)
        optimizer.optimize(AutoOptimizationConfig.with_optimization_level(level, for_gpu=False),
                           save_dir=out / level)
        record(level, out / level, "model_optimized.onnx", started)
    # Quantized: the plain export and each optimized graph, as far as ORTQuantizer can (it
    # cannot quantize a graph with ORT's fused contrib ops, whose types ONNX shape inference
    # does not know, and Optimum cannot pass ORT's `DefaultTensorType` option), with one weight
    # scale per tensor (`-int8`, Optimum's documented example) and/or per channel (`-int8-pc`,
    # the default of `avx512_vnni`).
    manifest["quantization"], manifest["failed"] = {}, {}
    for scales in args.int8:
        qconfig = AutoQuantizationConfig.avx512_vnni(is_static=False,
                                                     per_channel=scales == "channel")
        manifest["quantization"][scales] = {
            "format": qconfig.format.name, "mode": qconfig.mode.name,
            "per_channel": qconfig.per_channel, "reduce_range": qconfig.reduce_range,
            "weights_dtype": qconfig.weights_dtype.name,
            "activations_dtype": qconfig.activations_dtype.name,
            "weights_symmetric": qconfig.weights_symmetric,
            "activations_symmetric": qconfig.activations_symmetric,
            "operators": [getattr(op, "value", op) for op in qconfig.operators_to_quantize]}
        for source in ["plain", *args.levels]:
            started = time.perf_counter()
            name = f"{source}-int8" + ("-pc" if qconfig.per_channel else "")
            entry = manifest["files"][source]
            try:
                quantizer = ORTQuantizer.from_pretrained(entry["dir"],
                                                         file_name=entry["file_name"])
                quantizer.quantize(quantization_config=qconfig, save_dir=out / name)
            except Exception as error:  # noqa: BLE001 (reported, and the variant left out)
                manifest["failed"][name] = f"{type(error).__name__}: {str(error)[:300]}"
                shutil.rmtree(out / name, ignore_errors=True)
                continue
            if not (out / name / "config.json").is_file():
                shutil.copy(Path(entry["dir"]) / "config.json", out / name / "config.json")
            record(name, out / name, f"{Path(entry['file_name']).stem}_quantized.onnx",
                   started)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    say(manifest)


def worker(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer, pipeline

    if args.runtime == "openvino":
        from optimum.intel import OVModelForSequenceClassification

        model = OVModelForSequenceClassification.from_pretrained(
            args.model, file_name=args.file_name, ov_config={
                "INFERENCE_NUM_THREADS": args.threads, "PERFORMANCE_HINT": "LATENCY",
                "NUM_STREAMS": "1", **({"INFERENCE_PRECISION_HINT": args.precision}
                                       if args.precision else {})})
        info = {"versions": intel_versions()}
    else:
        import onnxruntime as ort
        from optimum.onnxruntime import ORTModelForSequenceClassification

        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        model = ORTModelForSequenceClassification.from_pretrained(
            args.model, file_name=args.file_name, session_options=options,
            provider="CPUExecutionProvider")
        info = {"versions": versions()}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer,
                        batch_size=args.batch_size, truncation=True, max_length=args.max_length,
                        device="cpu")
    texts = json.loads(Path(args.texts).read_text())
    reply: dict = {"ready": True, **info, "fast_tokenizer": tokenizer.is_fast,
                   "texts": len(texts)}
    say(reply)
    for line in sys.stdin:
        command = json.loads(line)["cmd"]
        if command == "quit":
            break
        started = time.perf_counter()
        results = classify(texts)
        seconds = time.perf_counter() - started
        reply = {"seconds": seconds}
        if command == "labels":
            reply["labels"] = [r["label"] for r in results]
        say(reply)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--task", choices=["feature-extraction", "text-classification"],
                   required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--levels", nargs="+", default=["O1", "O2", "O3"],
                   choices=["O1", "O2", "O3"])
    p.add_argument("--int8", nargs="*", choices=["tensor", "channel"],
                   default=["tensor", "channel"],
                   help="weight scales of the INT8 files: per tensor (`-int8`), per channel "
                        "(`-int8-pc`)")
    p = sub.add_parser("worker")
    p.add_argument("--model", required=True, help="a directory `export` wrote")
    p.add_argument("--file-name", required=True)
    p.add_argument("--texts", required=True, help="JSON list of strings")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--runtime", choices=["onnxruntime", "openvino"], default="onnxruntime")
    p.add_argument("--precision", default=None,
                   help="OpenVINO's INFERENCE_PRECISION_HINT (f32, bf16; default: OpenVINO's)")
    p = sub.add_parser("export-ov")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--task", choices=["feature-extraction", "text-classification"],
                   required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--calibration-texts", default=None, help="JSON list of strings")
    p.add_argument("--calibration-ids", default=None, help=".npz of token id rows")
    p.add_argument("--calibration-rows", type=int, default=300)
    p.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Replies go to the real stdout only: whatever the libraries print goes to stderr.
    global REPLY
    REPLY = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    {"export": export, "worker": worker, "export-ov": export_ov}[args.command](args)


if __name__ == "__main__":
    main()

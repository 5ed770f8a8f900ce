"""What `popbert.export.openvino.convert`'s rewrites buy: the same FP32 ONNX export converted
by OpenVINO's converter alone and by popbert's `convert` (fused projections split, NaN guards
after attention dropped), each made static INT8 by NNCF on the same calibration rows and timed
side by side in OpenVINO, in rotating blocks, with the same settings as `benchmarks/inference.py`
(compiled for each shape, `--threads` threads, one stream, the INT8 IRs' other operations at the
precision `popbert export` stores). Also checks that the two FP32 models give the same outputs.

    python benchmarks/openvino_rewrite.py --models base minilm --work-dir runs/inference-ov

The FP32 exports and calibration rows come from `benchmarks/inference.py`'s fixed part, made
here if `--work-dir` has none yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inference  # noqa: E402  (the models, their exports, the calibration rows, the timer)

VARIANTS = ("converter", "popbert-convert")


def int8_irs(onnx_fp32: Path, calibration: Path, rows: int, directory: Path
             ) -> dict[str, Path]:
    """Both INT8 IRs of `onnx_fp32`, cached in `directory`."""
    import openvino as ov

    from popbert.export.openvino import convert, quantize

    converters = {"converter": lambda: ov.convert_model(str(onnx_fp32)),
                  "popbert-convert": lambda: convert(onnx_fp32)}
    arrays = np.load(calibration)
    files = {}
    for name, make in converters.items():
        target = directory / name / "model.xml"
        files[name] = target
        if not target.is_file():
            model = make()
            inputs = [i.get_any_name() for i in model.inputs]
            quantized = quantize(model, [{k: arrays[k][i:i + 1] for k in inputs}
                                         for i in range(rows)])
            ov.save_model(quantized, str(target), compress_to_fp16=False)
    return files


def feeds_for(compiled, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`inference.batch`'s arrays under the input names of the compiled IR."""
    return {i.get_any_name(): arrays[inference.INPUT_ROLES[i.get_any_name()]]
            for i in compiled.inputs}


def fp32_difference(onnx_fp32: Path, seq: int, vocab: int) -> float:
    """Largest absolute output difference between the two FP32 conversions, padded rows
    included."""
    import openvino as ov

    from popbert.export.openvino import convert
    from popbert.serve.openvino_ir import compile_model, run

    arrays = inference.batch(4, seq, vocab, seed=3)
    arrays["mask"][1, seq // 3:] = 0
    plain = compile_model(ov.convert_model(str(onnx_fp32)), "f32")
    rewritten = compile_model(convert(onnx_fp32), "f32")
    feeds = feeds_for(plain, arrays)
    expected, got = run(plain, feeds), run(rewritten, feeds)
    return max(float(np.abs(expected[k] - got[k]).max()) for k in expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(inference.MODELS),
                        default=["base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12, help="timed calls per variant at "
                        "batch 1 (a quarter of them, at least 3, at larger batches)")
    parser.add_argument("--calibration-rows", type=int, default=300)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/inference-ov"))
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = parser.parse_args()

    import os

    from popbert.serve.openvino_ir import resolve_precision

    precision = resolve_precision("auto")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": inference.machine(), "load_start": os.getloadavg(),
              "command": "python " + " ".join(sys.argv), "int8_other_precision": precision,
              "rows": []}
    print(f"# {report['date']}, load {report['load_start'][0]:.2f}, INT8 IRs' other "
          f"operations at {precision}, {args.threads} threads\n")
    print("| model | batch | converter alone (ms) | popbert's convert (ms) | speed-up | "
          "FP32 outputs differ by |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for key in args.models:
        label, load = inference.MODELS[key]
        directory = args.work_dir / "fixed" / key
        directory.mkdir(parents=True, exist_ok=True)
        model, state, _ = load(directory)
        onnx_fp32 = directory / "popbert" / "popbert-fp32.onnx"
        if not onnx_fp32.is_file():
            inference.encoder_exports(model, state, directory / "popbert",
                                      args.sequence_length, ["popbert-fp32"])
        vocab = model.config.vocab_size
        calibration = directory / "calibration.npz"
        if not calibration.is_file():
            inference.calibration_ids(calibration, args.calibration_rows,
                                      args.sequence_length, vocab)
        files = int8_irs(onnx_fp32, calibration, args.calibration_rows,
                         directory / "rewrite")
        difference = fp32_difference(onnx_fp32, args.sequence_length, vocab)
        for batch_size in args.batch_sizes:
            arrays = inference.batch(batch_size, args.sequence_length, vocab)
            runners = {}
            for name in VARIANTS:
                compiled, _ = inference.ov_compiled(files[name], precision, args.threads,
                                                    (batch_size, args.sequence_length))
                feeds = feeds_for(compiled, arrays)
                runners[name] = (lambda c=compiled, f=feeds: c(f))
            rounds = args.rounds if batch_size == 1 else max(3, args.rounds // 4)
            times = inference.time_rotating(runners, rounds)
            median = {name: statistics.median(values) for name, values in times.items()}
            row = {"model": label, "batch": batch_size, "ms": median, "times_ms": times,
                   "speed_up": median["converter"] / median["popbert-convert"],
                   "fp32_max_abs_diff": difference, "load": os.getloadavg()[0]}
            report["rows"].append(row)
            print(f"| {label} | {batch_size} | {median['converter']:.1f} | "
                  f"{median['popbert-convert']:.1f} | {row['speed_up']:.2f}x | "
                  f"{difference:.1g} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""How fast could an export be on this machine? The ceiling ONNX Runtime's CPU GEMMs set on
issue 21's speed goals (INT8 >= 5x / 4.5x transformers eager at batch 1 / 32, fused FP32 >= 2.5x
eager at batch 1), measured in one run beside the exports themselves.

A BERT encoder call is mostly its weight GEMMs: per layer x @ W_qkv, x @ W_out, x @ W_ffn_in,
gelu(...) @ W_ffn_out. This script builds an ONNX graph that holds those GEMMs alone (the model's
shapes and count, random weights, no attention, LayerNorm, GELU, residual or embedding) and times
it as FP32 `MatMul`s and, through `popbert.export.quantize.quantize_int8` (the path `popbert export
--quantize int8` takes), as INT8 `DynamicQuantizeMatMul`s; beside it, interleaved in blocks whose
order rotates, `transformers` eager (the goals' reference) and popbert's FP32 and INT8 encoder
exports. `eager / GEMMs alone` is then the speed-up an export would reach if everything but its
GEMMs cost nothing: no graph rewrite, fusion or kernel choice for the other operators can do
better with these GEMM kernels, so a goal above that ceiling is out of reach of ONNX Runtime's CPU
provider on this machine. The attention products are left out, which makes the ceiling generous;
the one copy per layer that chains the GEMMs (a Slice of the query's columns) is the graph's
only other work, 1-5% of its time.

A runtime other than ONNX Runtime has other kernels and another ceiling:
`benchmarks/openvino_probe.py` measures one.

    python benchmarks/inference_ceiling.py                        # MiniLM and BERT-Base, 2 threads
    python benchmarks/inference_ceiling.py --models minilm --json ceiling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inference  # noqa: E402  (benchmarks/inference.py: models, exports, sessions, timer)

GOALS = {"int8": {1: 5.0, 32: 4.5}, "fp32": {1: 2.5}}


def gemm_graph(layers: int, hidden: int, ffn: int, rows: int, seed: int = 0) -> onnx.ModelProto:
    """The encoder's weight GEMMs alone, chained as a layer chains them: [rows, hidden] @ QKV,
    its first `hidden` columns @ Out, @ FFN-in, @ FFN-out, into the next layer; one output, so
    intermediate products live in ONNX Runtime's arena as they do in the model. Weight names
    follow the builder's, so `quantize_int8` gives each its role."""
    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    axis = numpy_helper.from_array(np.array([1], np.int64), "axis")
    starts, ends = (numpy_helper.from_array(np.array([v], np.int64), n)
                    for v, n in ((0, "start"), (hidden, "end")))
    source = "x"
    for layer in range(layers):
        for role, (k, n) in {"Attention/QKV": (hidden, 3 * hidden),
                             "Attention/Out": (hidden, hidden), "FF/1": (hidden, ffn),
                             "FF/2": (ffn, hidden)}.items():
            name = f"Layer{layer}/{role}"
            weights.append(numpy_helper.from_array(
                (rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"{name}/W"))
            nodes.append(helper.make_node("MatMul", [source, f"{name}/W"], [f"{name}/Y"],
                                          name=f"{name}/MatMul"))
            source = f"{name}/Y"
            if role == "Attention/QKV":  # the query's columns go on, as the context would
                nodes.append(helper.make_node("Slice", [source, "start", "end", "axis"],
                                              [f"{name}/Q"], name=f"{name}/Slice"))
                source = f"{name}/Q"
    graph = helper.make_graph(
        nodes, "gemms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, hidden])],
        [helper.make_tensor_value_info(source, TensorProto.FLOAT, [rows, hidden])],
        [*weights, starts, ends, axis])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def gemm_ops(layers: int, hidden: int, ffn: int, rows: int) -> float:
    """Multiply-adds x 2 of the graph above."""
    return 2.0 * layers * rows * hidden * (3 * hidden + hidden + 2 * ffn)


def prepare(key: str, work: Path) -> tuple[object, dict[str, Path]]:
    """The `transformers` model of `key` and popbert's FP32 and INT8 encoder exports of it."""
    model, state, _ = inference.MODELS[key][1](work)
    model.eval()
    files, _ = inference.encoder_exports(model, state, work / key, 128,
                                         ["popbert-fp32", "popbert-int8"])
    return model, files


def measure(model, exports: dict[str, Path], work: Path, batch: int, threads: int,
            rounds: int) -> dict:
    """Milliseconds per call of eager, the exports and the GEMMs alone at `batch` rows of 128."""
    import torch

    from popbert.export.quantize import quantize_int8

    torch.set_num_threads(threads)
    config = model.config
    rows = batch * 128
    gemms = gemm_graph(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                       rows)
    gemms_int8, _ = quantize_int8(gemms)
    files = dict(exports)
    for name, graph in (("gemms-fp32", gemms), ("gemms-int8", gemms_int8)):
        files[name] = work / f"{name}-{batch}.onnx"
        onnx.save(graph, str(files[name]))
    arrays = inference.batch(batch, 128, config.vocab_size)
    tensors = inference.hf_inputs(arrays)

    def eager():
        with torch.no_grad():
            return model(**tensors).last_hidden_state

    runners = {"hf": eager}
    rng = np.random.default_rng(0)
    gemm_feeds = {"x": rng.standard_normal((rows, config.hidden_size)).astype(np.float32)}
    for name, path in files.items():
        session = inference.ort_session(path, threads)
        feeds = gemm_feeds if name.startswith("gemms") else inference.feeds_for(session, arrays)
        runners[name] = (lambda s=session, f=feeds: s.run(None, f))
    for _ in range(2):
        for run in runners.values():
            run()
    times = inference.time_rotating(runners, rounds)
    ms = {name: statistics.median(values) for name, values in times.items()}
    ops = gemm_ops(config.num_hidden_layers, config.hidden_size, config.intermediate_size, rows)
    return {"ms": ms, "gemm_gops": ops / 1e9,
            "gemm_rate_gops": {k: ops / 1e6 / ms[f"gemms-{k}"] for k in ("fp32", "int8")}}


def lines(results: list[dict]) -> list[str]:
    out = ["| model | batch | HF eager (ms) | popbert FP32 | popbert INT8 | GEMMs alone FP32 "
           "| GEMMs alone INT8 | ceiling FP32 | ceiling INT8 | goal | INT8 outside its GEMMs |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        ms, hf, b = r["ms"], r["ms"]["hf"], r["batch"]
        goal = ", ".join(f"{kind.upper()} {g[b]}x" for kind, g in GOALS.items() if b in g)
        rate = r["gemm_rate_gops"]
        line = (f"| {r['model']} | {b} | {hf:.1f} | {ms['popbert-fp32']:.1f} "
                f"({hf / ms['popbert-fp32']:.2f}x) | {ms['popbert-int8']:.1f} "
                f"({hf / ms['popbert-int8']:.2f}x) | {ms['gemms-fp32']:.1f} "
                f"({rate['fp32']:.0f} GFLOP/s) | {ms['gemms-int8']:.1f} ({rate['int8']:.0f} "
                f"GOP/s) | {hf / ms['gemms-fp32']:.2f}x | {hf / ms['gemms-int8']:.2f}x | {goal} "
                f"| {1 - ms['gemms-int8'] / ms['popbert-int8']:.0%} |")
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(inference.MODELS),
                        default=["minilm", "base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--threads", type=int, default=inference.GOAL_THREADS)
    parser.add_argument("--rounds", type=int, default=45, help="timed calls per variant at "
                        "batch 1 (a fifth of that, at least 6, at larger batches)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{started}; {platform.processor() or platform.machine()}, load average "
          f"{os.getloadavg()[0]:.2f}, {args.threads} threads, sequence 128", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="popbert-ceiling-") as tmp:
        for key in args.models:
            model, exports = prepare(key, Path(tmp))
            for batch in args.batch_sizes:
                rounds = args.rounds if batch == 1 else max(6, args.rounds // 5)
                result = measure(model, exports, Path(tmp) / key, batch, args.threads, rounds)
                result.update(model=inference.MODELS[key][0], batch=batch)
                results.append(result)
                print("\n".join(lines([result])[2:]), flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}\n")
    print("\n".join(lines(results)))
    if args.json:
        args.json.write_text(json.dumps({"started": started, "threads": args.threads,
                                         "machine": inference.machine(), "results": results},
                                        indent=1))


if __name__ == "__main__":
    sys.exit(main())

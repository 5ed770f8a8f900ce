"""The CPU one text costs in an embedding export, outside any server: what `popbert serve`'s
server CPU per request (benchmarks/serve.py) is to be set against.

Each model runs the first `--texts` leads of `benchmarks/data/topic-test.jsonl` (the texts the
serving benchmark sends) through `popbert.serve.embed.EmbedPredictor` at each batch size, after
a warm-up, and prints the process CPU time (all threads, `time.process_time`) and wall time per
text (predict's progress bars go to stderr). The exports are the ones `benchmarks/serve.py`
builds in its `--work` folder:

    python benchmarks/model_cpu_per_text.py --threads 2 \
        --model /tmp/sbw/openvino-int8 /tmp/sbw/minilm-int8.onnx
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DATA = Path(__file__).parent / "data" / "topic-test.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", required=True, help="embedding exports")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    args = parser.parse_args()
    from popbert.serve.embed import EmbedPredictor

    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines()][:args.texts]
    for path in args.model:
        predictor = EmbedPredictor(Path(path), args.threads)
        for batch_size in args.batch_sizes:
            predictor.embed(texts[:64], batch_size)  # warm-up
            cpu, wall = time.process_time(), time.perf_counter()
            predictor.embed(texts, batch_size)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"{Path(path).name:24s} batch {batch_size:3d}: "
                  f"{1000 * cpu / len(texts):6.2f} ms CPU / text, "
                  f"{1000 * wall / len(texts):6.2f} ms wall / text")


if __name__ == "__main__":
    main()

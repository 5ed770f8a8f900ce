"""A hand-written embedding server: FastAPI + sentence-transformers, what people write by hand.

One `SentenceTransformer.encode` per request (no batching across requests), run in FastAPI's
thread pool (a plain `def` route), so concurrent requests contend for the same torch threads.
`--threads` sets `torch.set_num_threads`. The baseline of `benchmarks/serve.py` (issue 41).

    python benchmarks/st_server.py --model FOLDER --port 8000 --threads 2

Routes: `GET /health`, `GET /v1/models`, `POST /v1/embeddings` with the OpenAI body
`{"model": NAME, "input": str | list[str]}` -> `{"object": "list", "data": [{"object":
"embedding", "embedding": [...], "index": i}], "model": NAME, "usage": {...}}`.
"""

import argparse
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: str | list[str]


def build_app(model_path: str, name: str, device: str = "cpu") -> FastAPI:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path, device=device)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/embeddings")
    def embeddings(request: EmbeddingRequest) -> dict:
        texts = [request.input] if isinstance(request.input, str) else request.input
        vectors = model.encode(texts, convert_to_numpy=True)
        return {"object": "list", "model": name,
                "data": [{"object": "embedding", "embedding": vector.tolist(), "index": i}
                         for i, vector in enumerate(vectors)],
                "usage": {"prompt_tokens": 0, "total_tokens": 0}}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a sentence-transformers folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    args = parser.parse_args()

    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    app = build_app(args.model, Path(args.model).name, args.device)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

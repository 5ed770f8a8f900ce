"""Pre-train BERT: a thin wrapper over `popbert pretrain` (same arguments).

    python examples/pretrain.py                                   # tiny preset, CPU, ~2 minutes
    python examples/pretrain.py --config base-128 --set execution.device=cuda
    python examples/pretrain.py --config my.yaml --output-dir runs/my-run
    python examples/pretrain.py --resume runs/my-run/checkpoint   # continue after a stop
"""

import sys

from popbert.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))

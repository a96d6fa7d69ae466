"""MTP drafter training: `examples/train_drafter.py` with `drafter_type: mtp` (the default)."""

import sys

from train_drafter import main


if __name__ == "__main__":
    main(sys.argv[1:])

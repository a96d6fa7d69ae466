"""`angelspec export`: a trained drafter in the checkpoint layout SGLang / vLLM load (DFlash or EAGLE-3)."""

from __future__ import annotations

import argparse

from ..arguments import TARGET_DTYPES
from .common import UsageError, check_drafter, check_writable


NAME = "export"
HELP = "a trained drafter in the checkpoint layout SGLang / vLLM load (DFlash or EAGLE-3)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="a drafter folder, shipped drafter name or Hub id")
    parser.add_argument(
        "--format", choices=["dflash", "eagle3"], default="dflash", help="the layout: dflash (DFly) or eagle3 (MTP)"
    )
    parser.add_argument("--output", required=True, help="folder for model.safetensors and config.json")
    parser.add_argument(
        "--dtype",
        choices=TARGET_DTYPES,
        default=None,
        help="tensor dtype (default: the drafter's)",
    )


def check(args: argparse.Namespace) -> None:
    check_drafter(args.drafter)
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..export import EXPORT_FORMATS
    from ..hub import load_drafter

    drafter = load_drafter(args.drafter)
    try:
        folder = EXPORT_FORMATS[args.format](
            drafter, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None
        )
    except ValueError as error:
        raise UsageError(f"--drafter {args.drafter}: {error}") from None
    print(f"{args.format} checkpoint in {folder}")
    return 0

"""`angelspec serve`: an OpenAI-compatible HTTP server on the batched engine (D-cut across the live requests)."""

from __future__ import annotations

import argparse
import importlib.util

from ..arguments import add_target_arguments, load_target_from_args, policy, positive_float, positive_int
from .common import UsageError, check_drafter, check_target_arguments


NAME = "serve"
HELP = "an OpenAI-compatible server (/v1/chat/completions, /v1/completions, /metrics) on the batched engine"
SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def check_serving_installed() -> None:
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serving needs {', '.join(missing)}: pip install 'angelspec_hf[serve]'")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument("--drafter", default=None, help="a shipped drafter's name or a folder (none: plain batching)")
    parser.add_argument("--policy", type=policy, default="dcut", help="verify policy: dcut, heuristic or constant-K")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=positive_int, default=16, help="most requests decoded together")
    parser.add_argument(
        "--max-pending", type=positive_int, default=256, help="most requests held (running + queued); more get 429"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="max_tokens of a request that sets none")
    parser.add_argument(
        "--request-timeout", type=positive_float, default=600.0, help="seconds a request may take, queue included"
    )
    parser.add_argument(
        "--shutdown-grace", type=positive_float, default=30.0, help="seconds live requests get to finish on SIGTERM"
    )
    parser.add_argument("--served-model-name", default=None, help="the model id clients name (default: --target)")


def check(args: argparse.Namespace) -> None:
    check_serving_installed()
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port}: not a port number")
    check_target_arguments(args)
    check_drafter(args.drafter)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..hub import load_drafter
    from ..serving import build_app

    target = load_target_from_args(args)
    drafter = load_drafter(args.drafter, target.model, target.tokenizer) if args.drafter else None
    app, _ = build_app(
        target.model,
        target.tokenizer,
        drafter,
        policy=args.policy,
        model_name=args.served_model_name or args.target,
        max_batch_size=args.max_batch_size,
        max_pending=args.max_pending,
        default_max_tokens=args.max_tokens,
        request_timeout=args.request_timeout,
    )
    # On SIGTERM uvicorn stops accepting, lets open requests finish (up to the grace), then the app's lifespan
    # stops the engine loop, which ends whatever is left with an error.
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.shutdown_grace, log_level="info")
    return 0

"""Serving the batched engine over HTTP (`angelspec serve`): the engine's thread, the OpenAI-compatible app, the
Prometheus metrics. Needs the `[serve]` extra (FastAPI, uvicorn, prometheus_client)."""

from .app import create_app
from .engine_loop import EngineLoop, LiveRequest, Progress, ServerBusy, ShuttingDown
from .metrics import ServerMetrics
from .server import background_server, build_app


__all__ = [
    "EngineLoop",
    "LiveRequest",
    "Progress",
    "ServerBusy",
    "ServerMetrics",
    "ShuttingDown",
    "background_server",
    "build_app",
    "create_app",
]

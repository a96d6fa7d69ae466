"""Building and running a server: `build_app` (the engine, its loop, the app) and `background_server` (uvicorn in
a thread of this process, for the load benchmark and the tests; `angelspec serve` runs uvicorn in the foreground)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from ..generation.engine import SpeculativeEngine
from .app import create_app
from .engine_loop import EngineLoop
from .metrics import ServerMetrics


def build_app(
    target,
    tokenizer,
    drafter=None,
    policy=None,
    model_name: str = "model",
    max_batch_size: int = 16,
    max_pending: int = 256,
    **app_options,
):
    """The app serving `target` (with `drafter`, or none) through a batched engine; returns (app, engine loop)."""
    engine = SpeculativeEngine(target, drafter, policy=policy, max_batch_size=max_batch_size, tokenizer=tokenizer)
    loop = EngineLoop(engine, max_pending=max_pending, metrics=ServerMetrics())
    return create_app(loop, tokenizer, model_name, **app_options), loop


@contextlib.contextmanager
def background_server(app, host: str = "127.0.0.1", start_timeout: float = 60.0):
    """Serve `app` on a free port of `host` from a thread; yields the base URL; stops it (gracefully) on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="angelspec-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()

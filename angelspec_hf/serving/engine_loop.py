"""The batched engine behind a server: one thread owns a `SpeculativeEngine` and runs it round after round.

Requests from the server's event loop join between rounds (D-cut ranks the drafted tokens of every live request
together), and leave between rounds: finished, cancelled by their client, or past their deadline. Each request's new
tokens go back to the event loop as they are verified. The engine is single-threaded by design (one batch, one
cache); this thread is the only one that touches it, the others talk to it through a queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from transformers.utils import logging

from ..generation.engine import Request, RequestOutput, SpeculativeEngine


logger = logging.get_logger(__name__)


class ServerBusy(Exception):
    """The server holds as many requests as it may (`max_pending`): answered 429."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new request: answered 503."""


@dataclass
class Progress:
    """What a request has produced since its last `Progress`: new token ids, and once it is over, why."""

    tokens: list[int]
    finish_reason: str | None = None  # eos, length, error, cancelled, timeout, shutdown
    error: str | None = None


@dataclass
class LiveRequest:
    """A request in the server: its engine request, where its progress goes, and its timings."""

    request: Request
    loop: asyncio.AbstractEventLoop
    deadline: float | None  # time.monotonic() after which it is cut off
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output: RequestOutput | None = None
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None
    delivered: int = 0  # tokens handed to the event loop
    rounds_seen: int = 0  # verify rounds already counted in the metrics
    cut: str | None = None  # why the server ended it early: "cancelled", "timeout" or "shutdown"


class EngineLoop:
    """Run `engine` in a thread of its own; `submit` and `cancel` are called from the server's event loop.

    Args:
        engine: the batched engine (with a drafter or none).
        max_pending: most requests held at once, running and waiting; more are refused (`ServerBusy`).
        metrics: where the loop reports (a `ServerMetrics`), or None.
    """

    def __init__(self, engine: SpeculativeEngine, max_pending: int = 256, metrics=None):
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
        self.engine = engine
        self.max_pending = max_pending
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: list[LiveRequest] = []  # owned by the engine thread
        self._pending = 0  # requests submitted and not yet over; guarded by _lock
        self._lock = threading.Lock()
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- called from the event loop ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="angelspec-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, request: Request, timeout: float | None = None) -> LiveRequest:
        """Hand `request` to the engine; its progress arrives on the returned request's `events` queue. Raises
        `ShuttingDown` or `ServerBusy` instead of queueing when it cannot be taken."""
        live = LiveRequest(
            request, asyncio.get_running_loop(), None if timeout is None else time.monotonic() + timeout
        )
        with self._lock:
            if self._closing:
                raise ShuttingDown("the server is shutting down and takes no new request")
            if self._pending >= self.max_pending:
                raise ServerBusy(
                    f"the server holds {self._pending} requests, its most (--max-pending {self.max_pending}); retry"
                )
            self._pending += 1
        self._inbox.put(("submit", live))
        return live

    def cancel(self, live: LiveRequest) -> None:
        """Its client went away (or a stop string ended it): free its row before the next round."""
        self._inbox.put(("cancel", live))

    def stop(self, grace: float = 30.0) -> None:
        """Take no new request; let the live ones finish for up to `grace` seconds, then end them with an error
        ("shutdown"); stop the thread."""
        with self._lock:
            self._closing = True
        deadline = time.monotonic() + grace
        while self._pending and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.05)
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the engine thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self._take_commands(wait=not self.engine.has_unfinished()):
                break
            if self.engine.has_unfinished():
                try:
                    self.engine.step()
                except Exception as error:  # noqa: BLE001  (the engine reports on outputs; anything else ends them all)
                    logger.warning(f"The engine failed outside any request ({type(error).__name__}: {error})")
                    for live in self._live:
                        self._cut(live, "error", f"{type(error).__name__}: {error}")
                self.engine.stats.round_seconds.clear()  # a server runs for days: keep no per-round history
            self._publish()
        for live in list(self._live):
            self._cut(live, "shutdown", "the server shut down before this request finished")
        self._publish()

    def _take_commands(self, wait: bool) -> bool:
        """Apply every queued command (waiting up to 0.1 s for one when the engine is idle); False on "stop"."""
        try:
            command = self._inbox.get(timeout=0.1) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, live = command
            if kind == "stop":
                return False
            if kind == "submit":
                live.output = self.engine.submit(live.request)
                self._live.append(live)
            elif kind == "cancel" and live.output is not None:
                self._cut(live, "cancelled")
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _cut(self, live: LiveRequest, reason: str, error: str | None = None) -> None:
        """End a live request early (`reason`: cancelled, timeout, shutdown, error)."""
        if live.output.finish_reason is None:
            self.engine.cancel(live.output)
            live.cut = reason
            live.output.error = error

    def _publish(self) -> None:
        """Send each live request its new tokens; forget the finished ones."""
        now = time.monotonic()
        still = []
        for live in self._live:
            if live.deadline is not None and now > live.deadline:
                self._cut(live, "timeout", "the request ran past the server's --request-timeout")
            output = live.output
            tokens = output.output_ids[live.delivered :]
            if tokens and live.first_token is None:
                live.first_token = now
            live.delivered += len(tokens)
            finish = output.finish_reason
            if finish is not None:
                finish = live.cut or finish
                live.finished = now
            if self.metrics is not None:
                drafted = output.stats.drafted[live.rounds_seen :]
                live.rounds_seen += len(drafted)
                self.metrics.observe_progress(live, len(tokens), drafted)
            if finish is None:
                still.append(live)
            else:  # counted out before its client hears of it
                with self._lock:
                    self._pending -= 1
                if self.metrics is not None:
                    self.metrics.observe_finished(live, finish)
            if tokens or finish is not None:
                self._send(live, Progress(tokens, finish, output.error if finish is not None else None))
        self._live = still
        if self.metrics is not None:
            self.metrics.observe_engine(running=len(self.engine.rows), waiting=len(self._live) - len(self.engine.rows))

    @staticmethod
    def _send(live: LiveRequest, progress: Progress) -> None:
        try:
            live.loop.call_soon_threadsafe(live.events.put_nowait, progress)
        except RuntimeError:  # its event loop is closed: nobody is waiting for it
            pass

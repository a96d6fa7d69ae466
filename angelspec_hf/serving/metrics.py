"""The server's `/metrics`, in Prometheus' text format (`prometheus_client`, one registry per server).

Requests by endpoint and outcome, prompt and output tokens, requests running and waiting, output tokens per second
over the last `WINDOW_SECONDS`, time to first token, time per output token, D-cut's verified depth per request
and round (the drafted tokens the target verified), and τ: output tokens per request-round (a round is one row of
one target forward), the bonus token included.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


WINDOW_SECONDS = 10.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "angelspec_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=registry
        )
        self.prompt_tokens = Counter(
            "angelspec_prompt_tokens", "Prompt tokens of admitted requests", registry=registry
        )
        self.output_tokens = Counter("angelspec_generation_tokens", "Output tokens generated", registry=registry)
        self.rounds = Counter("angelspec_request_rounds", "Request-rounds: rows of target forwards", registry=registry)
        self.running = Gauge("angelspec_requests_running", "Requests in the engine's batch", registry=registry)
        self.waiting = Gauge("angelspec_requests_waiting", "Requests queued for the batch", registry=registry)
        self.throughput = Gauge(
            "angelspec_generation_tokens_per_second",
            f"Output tokens per second over the last {WINDOW_SECONDS:.0f} s",
            registry=registry,
        )
        self.tau = Gauge(
            "angelspec_tokens_per_target_forward", "τ: output tokens per request-round since start", registry=registry
        )
        self.time_to_first_token = Histogram(
            "angelspec_time_to_first_token_seconds",
            "From submission to the first output token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "angelspec_time_per_output_token_seconds",
            "From the first to the last output token, per token after the first",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.verified_depth = Histogram(
            "angelspec_verified_depth",
            "Drafted tokens verified per request and round (D-cut's depth; 0: verified none)",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
            registry=registry,
        )
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._round_tokens = 0  # output tokens made by verify rounds (each request's first comes from its prefill)
        self._round_count = 0
        self._lock = threading.Lock()

    def observe_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def observe_progress(self, live, new_tokens: int, drafted: list[int]) -> None:
        """A live request produced `new_tokens` in rounds that verified `drafted[i]` drafted tokens each."""
        if drafted:
            self.rounds.inc(len(drafted))
            for depth in drafted:
                self.verified_depth.observe(depth)
        if new_tokens:
            self.output_tokens.inc(new_tokens)
            from_prefill = 1 if live.delivered == new_tokens else 0  # its first tokens: the prefill made one
            with self._lock:
                self._recent.append((time.monotonic(), new_tokens))
                self._forget_old(time.monotonic())
                self._round_tokens += new_tokens - from_prefill
                self._round_count += len(drafted)

    def observe_finished(self, live, finish_reason: str) -> None:
        self.prompt_tokens.inc(len(live.output.prompt_ids))
        if live.first_token is not None:
            self.time_to_first_token.observe(live.first_token - live.submitted)
            if live.delivered > 1:
                self.time_per_output_token.observe((live.finished - live.first_token) / (live.delivered - 1))

    def observe_engine(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, the gauges derived from counters brought up to date."""
        with self._lock:
            self._forget_old(time.monotonic())
            self.throughput.set(sum(count for _, count in self._recent) / WINDOW_SECONDS)
            self.tau.set(self._round_tokens / self._round_count if self._round_count else 0.0)
        return generate_latest(self.registry)

    def _forget_old(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - WINDOW_SECONDS:
            self._recent.popleft()

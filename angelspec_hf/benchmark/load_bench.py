"""`angelspec serve-bench`: the OpenAI-compatible server under load, each drafter against the same server with none.

Two kinds of load, as serving benchmarks use them: closed-loop streams (`--streams 4,16`: that many clients, each
sending its next request when its answer is complete) and open-loop Poisson arrivals (`--rates 0.5,1`: requests
per second, exponential gaps, the same arrival times for every method). Each (method, load) runs on a fresh server
in this process, streamed through HTTP with the OpenAI wire format; per run: output tokens per second over the run,
latency, time to first token and time per output token (client-side, median and 90th/99th percentiles), τ from the
server's metrics, and how many greedy outputs equal the no-drafter server's.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

from transformers.utils import logging


logger = logging.get_logger(__name__)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def poisson_arrivals(rate: float, count: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of `count` requests at `rate` per second."""
    rng, clock, times = random.Random(seed), 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        times.append(clock)
    return times


async def stream_one(http, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion, greedy; its text, output tokens and client-side timings."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, pieces, tokens = None, [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                text = choice["delta"].get("content")
                if text:
                    first = first if first is not None else time.perf_counter()
                    pieces.append(text)
    end = time.perf_counter()
    return {
        "text": "".join(pieces),
        "tokens": tokens,
        "latency": end - start,
        "ttft": (first or end) - start,
        "tpot": (end - first) / (tokens - 1) if first is not None and tokens > 1 else None,
    }


async def closed_loop(url: str, prompts: list[str], streams: int, max_tokens: int) -> list[dict]:
    """`streams` clients taking prompts from one queue, each sending its next when its answer is complete."""
    import httpx

    queue = list(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)

    async def client(http):
        while queue:
            index, prompt = queue.pop(0)
            results[index] = await stream_one(http, prompt, max_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        await asyncio.gather(*(client(http) for _ in range(streams)))
    return results


async def open_loop(url: str, prompts: list[str], arrivals: list[float], max_tokens: int) -> list[dict]:
    """Each prompt sent at its arrival time, whatever is still running."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        start = time.perf_counter()

        async def at(when: float, prompt: str):
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            return await stream_one(http, prompt, max_tokens)

        return await asyncio.gather(*(at(when, prompt) for when, prompt in zip(arrivals, prompts)))


def server_tau(url: str) -> float | None:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("angelspec_tokens_per_target_forward "):
            return float(line.split()[1])
    return None


def run_load(target, tokenizer, methods: list[tuple[str, object]], prompts, loads, max_tokens, max_batch_size) -> dict:
    """Every method (name, drafter or None; None's first) under every load (("streams", n) or ("rate", r))."""
    from ..generation.session import forget_served_requests
    from ..serving import background_server, build_app

    report = {"max_tokens": max_tokens, "max_batch_size": max_batch_size, "requests": len(prompts), "loads": []}
    for kind, level in loads:
        runs, reference = [], None
        arrivals = poisson_arrivals(level, len(prompts)) if kind == "rate" else None
        for name, drafter in methods:
            if drafter is not None:
                forget_served_requests(drafter)  # every run starts from the drafter as loaded
            app, _ = build_app(target, tokenizer, drafter, max_batch_size=max_batch_size, max_pending=len(prompts))
            with background_server(app) as url:
                start = time.perf_counter()
                load = (
                    closed_loop(url, prompts, level, max_tokens)
                    if kind == "streams"
                    else open_loop(url, prompts, arrivals, max_tokens)
                )
                results = asyncio.run(load)
                seconds = time.perf_counter() - start
                tau = server_tau(url)
            runs.append(summarize_run(name, results, seconds, tau, reference))
            if reference is None:
                reference = [result.get("text") for result in results]
        baseline = runs[0]["tokens_per_s"]
        for run in runs:
            run["speedup"] = run["tokens_per_s"] / baseline if baseline else None
        report["loads"].append({"kind": kind, "level": level, "runs": runs})
    return report


def summarize_run(name: str, results: list[dict], seconds: float, tau: float | None, reference) -> dict:
    done = [result for result in results if "error" not in result]
    tokens = sum(result["tokens"] for result in done)
    column = {key: [r[key] for r in done if r.get(key) is not None] for key in ("latency", "ttft", "tpot")}
    run = {
        "name": name,
        "answered": len(done),
        "failed": [result["error"] for result in results if "error" in result][:5],
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "tau": tau,
        "identical": None
        if reference is None
        else sum(r.get("text") == ref for r, ref in zip(results, reference) if ref is not None),
    }
    for key, values in column.items():
        run[f"{key}_p50"] = statistics.median(values) if values else None
        run[f"{key}_p90"] = percentile(values, 0.9)
        run[f"{key}_p99"] = percentile(values, 0.99)
    return run


def format_load_table(report: dict) -> str:
    lines = [
        "| load | method | answered | tokens/s | speedup | τ | identical | latency p50 / p90 s | TTFT p50 s | TPOT p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for load in report["loads"]:
        label = f"{load['level']} streams" if load["kind"] == "streams" else f"{load['level']} req/s"
        for run in load["runs"]:
            tau = f"{run['tau']:.2f}" if run["tau"] else "—"
            identical = "—" if run["identical"] is None else f"{run['identical']}/{report['requests']}"
            tpot = f"{1000 * run['tpot_p50']:.1f}" if run["tpot_p50"] is not None else "—"
            lines.append(
                f"| {label} | {run['name']} | {run['answered']}/{report['requests']} | {run['tokens_per_s']:.1f} | "
                f"{run['speedup']:.2f}× | {tau} | {identical} | {run['latency_p50']:.2f} / {run['latency_p90']:.2f} | "
                f"{run['ttft_p50']:.2f} | {tpot} |"
            )
    return "\n".join(lines)


def write_load_plot(report: dict, path: str) -> None:
    """Throughput and time per output token against the load, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in ("streams", "rate"):
        loads = [load for load in report["loads"] if load["kind"] == kind]
        for name in dict.fromkeys(run["name"] for load in loads for run in load["runs"]):
            points = [(load["level"], run) for load in loads for run in load["runs"] if run["name"] == name]
            label = f"{name} ({'streams' if kind == 'streams' else 'req/s'})"
            left.plot([p for p, _ in points], [run["tokens_per_s"] for _, run in points], marker="o", label=label)
            right.plot(
                [p for p, _ in points], [1000 * (run["tpot_p50"] or 0) for _, run in points], marker="o", label=label
            )
    left.set_xlabel("load (concurrent streams or requests per second)")
    left.set_ylabel("output tokens/s")
    right.set_xlabel("load")
    right.set_ylabel("median time per output token (ms)")
    left.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

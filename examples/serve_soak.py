"""Issue 42's soak run: `--requests` requests at a Poisson `--rate` against `angelspec serve`'s app (the embedded
target, a drafter), a share of them malformed (`--bad-share`), streamed and plain taking turns. Checks that every good
request is answered with the target's own greedy text (`target.generate()` on the same chat prompt, computed once
per distinct prompt), every bad one gets a 4xx naming the problem, and the server process's memory (RSS) is flat
from the first hundred answers to the last. Writes a JSON report:

    OMP_NUM_THREADS=1 python examples/serve_soak.py --requests 1000 --rate 0.6 \
        --output benchmarks/issue42/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import torch

from angelspec_hf import load_drafter, load_target
from angelspec_hf.benchmark.load_bench import poisson_arrivals, stream_one
from angelspec_hf.generation.engine import resident_memory_bytes
from angelspec_hf.prompts import encode_chat, load_prompts
from angelspec_hf.serving import background_server, build_app


# Malformed bodies a client sends by mistake, each with a word its 4xx message must contain.
MALFORMED = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"prompt": "no messages here"}, "messages"),
    ("{not json", "JSON"),
]


def rss_mib() -> float:
    return resident_memory_bytes(torch.device("cpu")) / 2**20


async def plain_one(http, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    response = await http.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
    return {"text": response.json()["choices"][0]["message"]["content"]}


async def malformed_one(http, body, expected: str) -> dict:
    if isinstance(body, str):
        response = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = await http.post("/v1/chat/completions", json=body)
    message = response.json().get("error", {}).get("message", "") if response.status_code != 200 else ""
    return {
        "status": response.status_code,
        "message": message,
        "clear": 400 <= response.status_code < 500 and expected.lower() in message.lower(),
    }


async def soak(url: str, plan: list[dict], arrivals: list[float], max_tokens: int, memory: list) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        start, answered = time.perf_counter(), 0

        async def at(when: float, item: dict) -> dict:
            nonlocal answered
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            if item["kind"] == "bad":
                result = await malformed_one(http, item["body"], item["expected"])
            elif item["stream"]:
                result = await stream_one(http, item["prompt"], max_tokens)
            else:
                result = await plain_one(http, item["prompt"], max_tokens)
            answered += 1
            if answered % 100 == 0:
                memory.append({"answered": answered, "rss_mib": rss_mib(), "seconds": time.perf_counter() - start})
            return result

        return await asyncio.gather(*(at(when, item) for when, item in zip(arrivals, plan)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", default="smollm2-135m-instruct-router")
    parser.add_argument("--prompts", default="chat_code")
    parser.add_argument("--distinct-prompts", type=int, default=48)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--bad-share", type=float, default=0.05)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    prompts = load_prompts(args.prompts, limit=args.distinct_prompts)["prompt"]
    target = load_target(args.target)
    drafter = load_drafter(args.drafter)
    rng = random.Random(args.seed)
    plan = []
    for index in range(args.requests):
        if rng.random() < args.bad_share:
            body, expected = rng.choice(MALFORMED)
            plan.append({"kind": "bad", "body": body, "expected": expected})
        else:
            plan.append({"kind": "good", "prompt": rng.choice(prompts), "stream": index % 2 == 0})

    started = time.perf_counter()
    reference = {}
    for prompt in {item["prompt"] for item in plan if item["kind"] == "good"}:
        ids = torch.tensor([encode_chat(target.tokenizer, prompt)])
        output = target.model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        reference[prompt] = target.tokenizer.decode(
            output[0, ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
    reference_seconds = time.perf_counter() - started

    app, _ = build_app(
        target.model, target.tokenizer, drafter, max_batch_size=args.max_batch_size, max_pending=args.requests
    )
    memory = [{"answered": 0, "rss_mib": rss_mib(), "seconds": 0.0}]
    arrivals = poisson_arrivals(args.rate, args.requests, seed=args.seed)
    with background_server(app) as url:
        started = time.perf_counter()
        results = asyncio.run(soak(url, plan, arrivals, args.max_tokens, memory))
        seconds = time.perf_counter() - started

    good = [(item, result) for item, result in zip(plan, results) if item["kind"] == "good"]
    bad = [(item, result) for item, result in zip(plan, results) if item["kind"] == "bad"]
    unanswered = [result["error"] for _, result in good if "error" in result]
    different = [item["prompt"][:60] for item, result in good if result.get("text") != reference[item["prompt"]]]
    unclear = [(item["expected"], result) for item, result in bad if not result["clear"]]
    hundreds = [point["rss_mib"] for point in memory[1:]]
    report = {
        "drafter": args.drafter,
        "requests": args.requests,
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "seconds": seconds,
        "reference_seconds": reference_seconds,
        "good": len(good),
        "answered": len(good) - len(unanswered),
        "identical_to_generate": len(good) - len(unanswered) - len(different),
        "bad": len(bad),
        "bad_refused_clearly": len(bad) - len(unclear),
        "bad_statuses": sorted({result["status"] for _, result in bad}),
        "unanswered": unanswered[:5],
        "different": different[:5],
        "unclear": unclear[:5],
        "memory": memory,
        "rss_first_hundred_mib": hundreds[0] if hundreds else None,
        "rss_last_hundred_mib": hundreds[-1] if hundreds else None,
        "rss_median_mib": statistics.median(hundreds) if hundreds else None,
    }
    with open(args.output, "w") as handle:
        json.dump(report, handle, indent=2)
    print(json.dumps({key: value for key, value in report.items() if key != "memory"}, indent=2))


if __name__ == "__main__":
    main()

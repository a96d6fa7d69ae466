"""`angelspec bench --concurrency 1,4,...`: throughput of the batched engine per policy and concurrency.

At each concurrency C the same requests (the first `max(C, --min-requests)` prompts, each with `--max-new-tokens`)
run through batched AR and through every drafter with every verify policy (constant depths and D-cut), C at a time with
continuous refill. Reported per run: output tokens/s (prefill included: it is part of serving), speedup over batched
AR at that concurrency, decode tokens/s (prefill excluded), τ, acceptance by depth, identical fraction against
batched AR, time split, peak KV-cache bytes and peak resident memory (sampled every round). With `--repeats N` the
methods take turns N times; tokens/s is each one's median and the speedup the median of its per-repeat ratios to
batched AR.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

from ..generation.engine import Request, SpeculativeEngine
from ..generation.policies import profiled_rows
from ..generation.schedules import parse_label
from ..generation.session import forget_served_requests, memory_of
from ..generation.verify_cost import load_cost_model
from ..metrics import SpeculationStats, format_round_profile
from ..prompts import encode_chat
from .divergence import NEAR_TIE_GAP, divergence


def engine_run(
    target, drafter, policy: str, requests: list[Request], concurrency: int, cost_model=None, warm: bool = False
) -> tuple[dict, list]:
    """One engine run, the drafter as loaded (`forget_served_requests`: a suffix index would otherwise hold an
    earlier run's answers to these very prompts) unless `warm`; returns its metrics and the outputs."""
    if drafter is not None and not warm:
        forget_served_requests(drafter)
    engine = SpeculativeEngine(target, drafter, policy=policy, max_batch_size=concurrency, cost_model=cost_model)
    outputs = engine.generate([dataclasses.replace(r) for r in requests])
    stats = engine.stats
    pooled = sum((o.stats for o in outputs), SpeculationStats())
    tokens_per_s = stats.generated_tokens / stats.seconds if stats.seconds else 0.0
    decoding = stats.seconds - stats.phase_seconds["prefill"]
    return {
        "tokens_per_s": tokens_per_s,
        "decode_tokens_per_s": stats.generated_tokens / decoding if decoding > 0 else 0.0,
        "tau": pooled.tau if drafter is not None else 1.0,
        "acceptance_by_depth": pooled.acceptance_by_depth(),
        "generated_tokens": stats.generated_tokens,
        "seconds": stats.seconds,
        "rounds": stats.rounds,
        "skipped_draft_rounds": stats.skipped_drafts,
        "time_split": {name: value / stats.seconds for name, value in stats.phase_seconds.items()}
        if stats.seconds
        else {},
        "round_profile": stats.round_profile(),
        "peak_rows": stats.peak_rows,
        "peak_kv_cache_mib": stats.peak_cache_bytes / 2**20,
        "peak_rss_mib": stats.peak_rss_bytes / 2**20,
        "errors": [o.error for o in outputs if o.error],
    }, outputs


def run_engine_benchmark(
    target,
    tokenizer,
    drafters: list[tuple[str, object, tuple[str, ...]]],
    prompts: list[str],
    concurrencies: list[int],
    max_new_tokens: int,
    min_requests: int = 8,
    repeats: int = 1,
    warm: bool = False,
) -> dict:
    """Batched AR and every (drafter, policy) at every concurrency, on the same requests. With `repeats` > 1 the
    runs of a concurrency take turns (each repeat starting one method later), so a drift in the machine's speed touches
    every method alike; each method reports its median tokens/s, its speedup as the median over repeats of its tokens/s
    over batched AR's in the same repeat (paired, so that a slow stretch of the machine cancels), and its other metrics
    from its median-speed repeat. Each run starts from the drafters as loaded; with `warm` they keep what earlier runs
    served, and each run lists those runs (`served_before`): what its drafter had seen."""
    encoded = [encode_chat(tokenizer, prompt) for prompt in prompts]
    needed = max(max(concurrencies), min_requests)
    if len(encoded) < needed:
        raise ValueError(f"{len(encoded)} prompts for a concurrency of {max(concurrencies)}: need {needed}")
    # Profile the verify cost over every batch size the runs use before timing anything.
    rows = sorted(set(profiled_rows(max(concurrencies))) | set(concurrencies))
    uses_dcut = any(parse_label(label)[0] == "dcut" for _, _, labels in drafters for label in labels)
    cost_model = load_cost_model(target, rows=rows) if uses_dcut else None
    warm_up = [Request(encoded[0], max_new_tokens=4)]
    SpeculativeEngine(target, None, max_batch_size=1).generate(warm_up)
    for _, drafter, policies in drafters:
        for policy in policies:
            SpeculativeEngine(target, drafter, policy=policy, max_batch_size=1, cost_model=cost_model).generate(
                warm_up
            )
    methods = [("batched-ar", None, None)] + [
        (f"{name}[{policy}]", drafter, policy) for name, drafter, policies in drafters for policy in policies
    ]
    levels, served = [], {}  # with `warm`: per drafter, the runs it served so far
    for concurrency in tqdm(concurrencies, desc="concurrency"):
        requests = [
            Request(ids, max_new_tokens=max_new_tokens, request_id=i)
            for i, ids in enumerate(encoded[: max(concurrency, min_requests)])
        ]
        timed: dict[str, list] = {name: [] for name, _, _ in methods}
        for repeat in range(repeats):
            turn = repeat % len(methods)  # each repeat starts with the next method, so none always runs first
            for name, drafter, policy in methods[turn:] + methods[:turn]:
                metrics, outputs = engine_run(
                    target, drafter, policy, requests, concurrency, cost_model if drafter is not None else None, warm
                )
                if warm and drafter is not None:
                    metrics["served_before"] = list(served.setdefault(id(drafter), []))
                    served[id(drafter)].append(f"{name} at concurrency {concurrency}, repeat {repeat + 1}")
                timed[name].append((metrics, outputs))
        reference = timed["batched-ar"][0][1]
        runs = []
        for name, drafter, policy in methods:
            metrics = _median_repeat([metrics for metrics, _ in timed[name]])
            outputs = [output for _, repeat in timed[name] for output in repeat]
            same = sum(o.output_ids == r.output_ids for o, r in zip(outputs, reference * repeats))
            divergences = [
                {"request_id": r.request_id, **divergence(target, r.prompt_ids, r.output_ids, o.output_ids)}
                for o, r in zip(outputs, reference * repeats)
                if o.output_ids != r.output_ids
            ]
            metrics.update(name=name, identical_fraction=same / len(outputs), divergences=divergences)
            if drafter is not None and parse_label(policy)[0] == "dcut":
                metrics.update(memory_of(drafter).estimates.calibrator.report())
            runs.append(metrics)
        ar_repeats = [metrics["tokens_per_s"] for metrics, _ in timed["batched-ar"]]
        for (name, _, _), metrics in zip(methods, runs):  # paired: each repeat against AR's run beside it
            ratios = [m["tokens_per_s"] / ar if ar else 0.0 for (m, _), ar in zip(timed[name], ar_repeats)]
            metrics.update(speedup=statistics.median(ratios), repeat_speedups=ratios)
        levels.append({"concurrency": concurrency, "requests": len(requests), "repeats": repeats, "runs": runs})
    report = {
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "warm": warm,
        "concurrency": levels,
        "summary": summarize(levels),
    }
    if cost_model is not None:
        report["verify_cost"] = dataclasses.asdict(cost_model)
    broken = [
        (level["concurrency"], run["name"], d) for level in levels for run in level["runs"] for d in run["divergences"]
    ]
    broken = [entry for entry in broken if not entry[2]["near_tie"]]
    if broken:
        concurrency, name, first = broken[0]
        raise LosslessnessError(
            f"{len(broken)} outputs differ from batched AR beyond a near tie; the first: {name} at concurrency "
            f"{concurrency}, request {first['request_id']}, new token {first['position']} (top-2 margin "
            f"{first['margin']:.3g} >= {NEAR_TIE_GAP})"
        )
    return report


class LosslessnessError(RuntimeError):
    """A speculative output differs from plain decoding where the target's choice was not a near tie."""


def _median_repeat(repeats: list[dict]) -> dict:
    """The metrics of the median-speed repeat, with tokens/s and decode tokens/s the medians over all repeats."""
    ordered = sorted(repeats, key=lambda metrics: metrics["tokens_per_s"])
    metrics = dict(ordered[(len(ordered) - 1) // 2])
    for key in ("tokens_per_s", "decode_tokens_per_s"):
        metrics[key] = statistics.median(repeat[key] for repeat in repeats)
    metrics["repeat_tokens_per_s"] = [repeat["tokens_per_s"] for repeat in repeats]
    return metrics


def summarize(levels: list[dict]) -> dict:
    """Per drafter: D-cut vs the best constant depth at each concurrency, and where each constant depth loses to AR."""
    summary = {}
    for level in levels:
        by_drafter: dict[str, dict[str, dict]] = {}
        for run in level["runs"][1:]:
            drafter, _, label = run["name"].rpartition("[")
            by_drafter.setdefault(drafter, {})[label.rstrip("]")] = run
        for drafter, runs in by_drafter.items():
            entry = summary.setdefault(drafter, {"dcut_vs_best_constant": {}, "constant_slower_than_ar": {}})
            constant = {label: run for label, run in runs.items() if parse_label(label)[0] == "constant"}
            if "dcut" in runs and constant:
                best = max(constant, key=lambda label: constant[label]["tokens_per_s"])
                entry["dcut_vs_best_constant"][level["concurrency"]] = {
                    "best_constant": best,
                    "ratio": runs["dcut"]["tokens_per_s"] / constant[best]["tokens_per_s"],
                }
            for label, run in constant.items():
                if run["speedup"] < 1.0:
                    entry["constant_slower_than_ar"].setdefault(label, []).append(level["concurrency"])
    return summary


def format_engine_table(report: dict) -> str:
    """Markdown: one row per (concurrency, method)."""
    warm = ["Warm runs (--warm): each drafter kept the outputs of the runs before it (served_before in the JSON).\n"]
    lines = (warm if report.get("warm") else []) + [
        "| concurrency | method | tokens/s | vs batched AR | decode tokens/s | τ | identical to AR | "
        "round ms: target / draft / rest | peak KV cache MiB | peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for level in report["concurrency"]:
        for run in level["runs"]:
            lines.append(
                f"| {level['concurrency']} | {run['name']} | {run['tokens_per_s']:.1f} | {run['speedup']:.2f}× | "
                f"{run['decode_tokens_per_s']:.1f} | "
                f"{run['tau']:.2f} | {run['identical_fraction']:.0%} | {format_round_profile(run.get('round_profile'))} | "
                f"{run['peak_kv_cache_mib']:.1f} | {run['peak_rss_mib']:.0f} |"
            )
    for drafter, entry in report["summary"].items():
        ratios = ", ".join(
            f"C={c}: {v['ratio']:.2f}× of {v['best_constant']}" for c, v in entry["dcut_vs_best_constant"].items()
        )
        losers = (
            "; ".join(
                f"{p} at C={','.join(map(str, cs))}" for p, cs in sorted(entry["constant_slower_than_ar"].items())
            )
            or "none"
        )
        lines.append(
            f"\n{drafter}: D-cut vs best constant depth — {ratios}. Constant depths slower than batched AR: {losers}."
        )
    return "\n".join(lines)


def main(args, target, drafters, prompts: list[str]) -> dict:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    report = run_engine_benchmark(
        target.model,
        target.tokenizer,
        drafters,
        prompts,
        concurrencies,
        args.max_new_tokens,
        args.min_requests,
        repeats=args.repeats,
        warm=args.warm,
    )
    report["command"] = getattr(args, "command_line", None)
    report["threads"] = torch.get_num_threads()
    print(format_engine_table(report))
    return report

"""`angelspec suite`: every method side by side, per domain, in one run; JSON, Markdown, PNG plots, BENCHMARKS.md.

Domains: Spec-Bench's six categories (its multi-turn category is MT-bench's 80 questions; first turns are used),
GSM8K test and MBPP test, prompts spread evenly over each domain. Methods through `generate()`: AR (the baseline of
every ratio), transformers' prompt lookup decoding, transformers' assisted generation with its heuristic schedule on
an early-exit assistant (the target's first quarter of layers, the one compatible assistant available offline),
transformers' built-in DFlash generator on our DFlash-ablation checkpoint, and each shipped drafter with D-cut (MTP
with and without TTT, DFlash, DFly, the training-free suffix drafter, and the router over MTP + DFly + suffix). Then the batched engine:
batched AR vs MTP, DFly, the suffix drafter and the router at constant depths and with D-cut, over concurrencies, on the chat+math+code mix. A method that fails (for example a drafter for another target) is reported with its error; the rest of the suite runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass

from ..hub import load_drafter
from .bench import (
    Method,
    assisted_heuristic_method,
    drafter_methods,
    machine_state,
    markdown_table,
    method_row,
    method_table_header,
    prompt_lookup_method,
    run_benchmark,
)
from .engine_bench import format_engine_table, run_engine_benchmark


SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_SUBCATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DRAFTER_CARDS = {  # method kind -> model card folder (under --drafters-dir)
    "mtp": "smollm2-135m-instruct-mtp",
    "mtp-no-ttt": "smollm2-135m-instruct-mtp-no-ttt",
    "dflash": "smollm2-135m-instruct-dflash",
    "dfly": "smollm2-135m-instruct-dfly",
    "suffix": "smollm2-135m-instruct-suffix",
    "router": "smollm2-135m-instruct-router",
}

EARLY_EXIT_FRACTION = 4  # the heuristic assisted-generation baseline drafts with the target's first quarter of layers


@dataclass(frozen=True)
class SuiteSize:
    prompts_per_domain: int
    max_new_tokens: int
    concurrencies: tuple[int, ...]
    engine_max_new_tokens: int
    engine_policies: dict
    repeats: int
    shortest: bool = False  # the shortest prompts of each domain (a smoke run) instead of evenly spread ones
    engine_requests: int = 8  # requests per concurrency at least
    engine_repeats: int = 1  # engine runs, taking turns; the median tokens/s counts


QUICK = SuiteSize(  # a smoke run under 3 minutes: every method and both engine drafters, few tokens
    1,
    8,
    (1, 4),
    8,
    {"mtp": ("constant-2", "dcut"), "dfly": ("constant-4", "dcut"), "suffix": ("dcut",), "router": ("dcut",)},
    1,
    shortest=True,
    engine_requests=1,
)
FULL = SuiteSize(  # sized to finish within an hour on one CPU thread; every timing repeated twice (median)
    2,
    48,
    (1, 4, 16),
    32,
    {
        "mtp": ("constant-1", "constant-2", "constant-3", "dcut"),
        "dfly": ("constant-1", "constant-2", "constant-4", "constant-8", "dcut"),
        "suffix": ("constant-4", "dcut"),
        "router": ("dcut",),
    },
    2,
    engine_repeats=2,
)


def domain_prompts(per_domain: int, data_dir: str | None = None, shortest: bool = False) -> dict[str, list[str]]:
    """`per_domain` prompts of each domain, evenly spaced over it (so MT-bench's eight subcategories all appear),
    or its shortest ones."""
    from ..prompts import load_prompts

    spec = load_prompts("spec_bench", data_dir=data_dir)
    by_category: dict[str, list[str]] = {}
    for prompt, category in zip(spec["prompt"], spec["category"]):
        by_category.setdefault("mt_bench" if category in MT_BENCH_SUBCATEGORIES else category, []).append(prompt)
    by_category["gsm8k"] = load_prompts("gsm8k_test", data_dir=data_dir)["prompt"]
    by_category["mbpp"] = load_prompts("mbpp_test", data_dir=data_dir)["prompt"]
    chosen = {}
    for domain in SPEC_BENCH_CATEGORIES + ("gsm8k", "mbpp"):
        prompts = by_category.get(domain, [])
        if shortest:
            prompts = sorted(prompts, key=len)
        step = 1 if shortest else max(1, len(prompts) // per_domain)
        chosen[domain] = prompts[::step][:per_domain]
    return chosen


def suite_methods(target, drafters_dir: str) -> tuple[list[Method], dict]:
    """The generate() methods (each drafter with D-cut) and the loaded drafters by kind; a drafter that cannot be
    loaded becomes a failed method."""
    layers = target.model.config.get_text_config().num_hidden_layers
    methods, loaded = (
        [prompt_lookup_method(3), assisted_heuristic_method(target.model, max(1, layers // EARLY_EXIT_FRACTION))],
        {},
    )
    for kind, card in DRAFTER_CARDS.items():
        path = os.path.join(drafters_dir, card)
        try:
            drafter = load_drafter(path, target.model, target.tokenizer)
        except (OSError, ValueError) as error:
            methods.append(Method(f"{kind}:{card}", error=f"{type(error).__name__}: {error}"))
            continue
        loaded[kind] = drafter
        methods += drafter_methods(card, drafter, schedules=("dcut",))
    return methods, loaded


def run_suite(target, size: SuiteSize, drafters_dir: str, data_dir: str | None = None) -> dict:
    """Run the whole suite; returns the JSON-ready report."""
    methods, loaded = suite_methods(target, drafters_dir)
    domains = {}
    for index, (domain, prompts) in enumerate(
        domain_prompts(size.prompts_per_domain, data_dir, size.shortest).items()
    ):
        domains[domain] = run_benchmark(
            target.model,
            target.tokenizer,
            methods,
            prompts,
            size.max_new_tokens,
            repeats=size.repeats,
            warm_up=index == 0,
        )
    engine_drafters = [
        (kind, loaded[kind], size.engine_policies[kind]) for kind in size.engine_policies if kind in loaded
    ]
    from ..prompts import load_prompts

    mixed = load_prompts("mixed", data_dir=data_dir, limit=max(max(size.concurrencies), size.engine_requests))[
        "prompt"
    ]
    engine = run_engine_benchmark(
        target.model,
        target.tokenizer,
        engine_drafters,
        mixed,
        list(size.concurrencies),
        size.engine_max_new_tokens,
        min_requests=size.engine_requests,
        repeats=size.engine_repeats,
    )
    return {
        "machine": machine_state(),
        "size": {key: (list(value) if isinstance(value, tuple) else value) for key, value in size.__dict__.items()},
        "domains": domains,
        "summary": summarize_domains(domains),
        "engine": engine,
    }


def summarize_domains(domains: dict) -> dict:
    """Per method: speedup and τ per domain, and their medians over domains."""
    summary: dict[str, dict] = {}
    for domain, report in domains.items():
        for method in report["methods"]:
            entry = summary.setdefault(method["name"], {"speedup": {}, "tau": {}, "error": None})
            if method.get("failed"):
                entry["error"] = method["error"]
                continue
            entry["speedup"][domain] = method["speedup"]
            entry["tau"][domain] = method["tau"]
    for entry in summary.values():
        for key in ("speedup", "tau"):
            values = list(entry[key].values())
            entry[f"median_{key}"] = statistics.median(values) if values else None
    return summary


def summary_table(report: dict) -> str:
    domains = list(report["domains"])
    lines = [
        "| method | " + " | ".join(domains) + " | median |",
        "| --- | " + " | ".join("---" for _ in domains) + " | --- |",
    ]
    for name, entry in report["summary"].items():
        if entry["error"] is not None and not entry["speedup"]:
            lines.append(f"| {name} | failed: {entry['error']} |" + " |" * len(domains))
            continue
        cells = [
            f"{entry['speedup'][d]:.2f}× (τ {entry['tau'][d]:.2f})" if d in entry["speedup"] else "—" for d in domains
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {entry['median_speedup']:.2f}× |")
    return "\n".join(lines)


def write_plots(report: dict, directory: str) -> list[str]:
    """PNG plots: speedup per domain per method, acceptance by position, engine throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    domains = list(report["domains"])
    methods = [name for name, entry in report["summary"].items() if entry["speedup"] and name != "ar"]
    figure, axis = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(1, len(methods))
    for index, name in enumerate(methods):
        values = [report["summary"][name]["speedup"].get(domain, 0.0) for domain in domains]
        axis.bar([d + index * width for d in range(len(domains))], values, width, label=name)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([d + 0.4 - width / 2 for d in range(len(domains))], domains)
    axis.set_ylabel("speedup vs AR")
    axis.set_title("Speedup per domain (greedy, outputs identical to AR)")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    paths.append(_save(figure, directory, "speedup_by_domain.png"))

    figure, axis = plt.subplots(figsize=(7, 4))
    pooled: dict[str, list[float]] = {}
    for report_domain in report["domains"].values():
        for method in report_domain["methods"]:
            if not method.get("failed") and method.get("acceptance_by_depth"):
                pooled.setdefault(method["name"], []).append(method["acceptance_by_depth"])
    for name, curves in pooled.items():
        length = max(map(len, curves))
        mean = [statistics.mean([c[k] for c in curves if len(c) > k]) for k in range(length)]
        axis.plot(range(1, length + 1), mean, marker="o", label=name)
    if not pooled:
        axis.text(0.5, 0.5, "no drafted token was verified", ha="center", transform=axis.transAxes)
    axis.set_xlabel("draft position")
    axis.set_ylabel("acceptance (given the earlier ones accepted)")
    axis.set_title("Acceptance by position, mean over domains")
    if pooled:
        axis.legend(fontsize=7)
    figure.tight_layout()
    paths.append(_save(figure, directory, "acceptance_by_position.png"))

    figure, axis = plt.subplots(figsize=(7, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for level in report["engine"]["concurrency"]:
        for run in level["runs"]:
            series.setdefault(run["name"], []).append((level["concurrency"], run["tokens_per_s"]))
    for name, points in series.items():
        axis.plot(*zip(*points), marker="o", label=name, linewidth=2.5 if name == "batched-ar" else 1.2)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("output tokens/s")
    axis.set_title("Batched engine: throughput vs concurrency")
    axis.legend(fontsize=7)
    figure.tight_layout()
    paths.append(_save(figure, directory, "throughput_vs_concurrency.png"))
    return paths


def _save(figure, directory: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(directory, name)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def markdown_report(report: dict, plots: list[str], relative_to: str, command: str | None) -> str:
    """BENCHMARKS.md: the command, the machine, the summary table, the plots, the per-domain and engine tables."""
    machine = report["machine"]
    size = report["size"]
    parts = [
        "# Benchmarks",
        "",
        f"Latest suite run, reproduced with `{command}`." if command else "Latest suite run.",
        "",
        f"Machine: {machine['cpu_count']} CPUs, {machine['threads']} torch threads, torch {machine['torch']}, "
        f"transformers {machine['transformers']}. {size['prompts_per_domain']} prompts per domain, "
        f"{size['max_new_tokens']} new tokens, greedy; every speculative output is checked against AR. Times are medians "
        f"of {size['repeats']} run(s) of each generation; the time split is drafting / target forwards / the rest "
        "(a dash: transformers' own drafters are not timed apart, their drafting is in the rest).",
        "",
        *(
            [
                "**This is a `--quick` smoke slice** (the shortest prompt of each domain, a few tokens): it shows that every",
                "method runs; its ratios are too small a sample to rank methods. The full suite is `angelspec suite`.",
                "",
            ]
            if report.get("size_name") == "quick"
            else []
        ),
        "## Speedup over AR per domain (τ in brackets)",
        "",
        summary_table(report),
        "",
    ]
    parts += [f"![{os.path.basename(p)}]({os.path.relpath(p, relative_to)})" for p in plots]
    for domain, result in report["domains"].items():
        parts += ["", f"## {domain}", "", markdown_table(result)]
    engine = report["engine"]
    parts += [
        "",
        "## Batched engine (chat + math + code mix)",
        "",
        f"{engine['max_new_tokens']} new tokens per request; tokens/s is the median of {engine.get('repeats', 1)} run(s) "
        "of each method, the methods taking turns.",
        "",
        format_engine_table(engine),
        "",
    ]
    return "\n".join(parts)


CARD_SECTION_START = "<!-- angelspec suite: start (written by `angelspec suite --update-model-cards`) -->"
CARD_SECTION_END = "<!-- angelspec suite: end -->"


def card_section(report: dict, card: str, kind: str) -> str:
    """A model card's share of a suite run: its drafter's rows per domain, and its engine runs."""
    lines = [
        CARD_SECTION_START,
        "## Benchmark suite (latest run)",
        "",
        f"From `{report.get('command') or 'angelspec suite'}` ({report.get('size_name', 'full')} run; "
        f"{report['size']['prompts_per_domain']} prompts per domain, {report['size']['max_new_tokens']} new tokens, greedy, "
        f"{report['machine']['threads']} torch thread(s)); all methods of that run are in [BENCHMARKS.md](../../BENCHMARKS.md).",
        "",
        *method_table_header("domain"),
    ]
    for domain, result in report["domains"].items():
        lines += [
            method_row(method, domain)
            for method in result["methods"]
            if method["name"].partition(":")[2].partition("[")[0] == card  # "kind:card[schedule]"
        ]
    engine_rows = [
        (level["concurrency"], run)
        for level in report["engine"]["concurrency"]
        for run in level["runs"]
        if run["name"] == "batched-ar" or run["name"].startswith(f"{kind}[")
    ]
    if any(run["name"] != "batched-ar" for _, run in engine_rows):
        lines += [
            "",
            "Batched engine, chat + math + code mix:",
            "",
            "| concurrency | policy | tokens/s | speedup vs batched AR | τ |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {concurrency} | {run['name']} | {run['tokens_per_s']:.1f} | {run['speedup']:.2f}× | {run['tau']:.2f} |"
            for concurrency, run in engine_rows
        ]
    lines.append(CARD_SECTION_END)
    return "\n".join(lines)


def update_model_cards(report: dict, drafters_dir: str) -> list[str]:
    """Rewrite (or append) the suite section of each shipped drafter's README.md; the rest of the card is kept."""
    updated = []
    for kind, card in DRAFTER_CARDS.items():
        path = os.path.join(drafters_dir, card, "README.md")
        if not os.path.isfile(path):
            continue
        with open(path) as handle:
            text = handle.read()
        section = card_section(report, card, kind)
        if CARD_SECTION_START in text and CARD_SECTION_END in text:
            before, rest = text.split(CARD_SECTION_START, 1)
            text = before + section + rest.split(CARD_SECTION_END, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
        with open(path, "w") as handle:
            handle.write(text)
        updated.append(path)
    return updated


def main(args) -> dict:
    from ..arguments import load_target_from_args

    size = QUICK if args.quick else FULL
    overrides = {
        "prompts_per_domain": args.prompts_per_domain,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
    }
    size = dataclasses.replace(size, **{key: value for key, value in overrides.items() if value is not None})
    target = load_target_from_args(args)
    report = run_suite(target, size, args.drafters_dir, args.data_dir)
    report["command"] = getattr(args, "command_line", None)
    report["size_name"] = "quick" if args.quick else "full"
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    plots = write_plots(report, args.output_dir)
    markdown_path = args.benchmarks_md or os.path.join(args.output_dir, "RESULTS.md")
    with open(markdown_path, "w") as handle:
        handle.write(
            markdown_report(report, plots, os.path.dirname(os.path.abspath(markdown_path)), report["command"])
        )
    print(summary_table(report))
    print(f"\nresults: {args.output_dir}/results.json, report: {markdown_path}")
    if args.update_model_cards:
        for path in update_model_cards(report, args.drafters_dir):
            print(f"model card updated: {path}")
    return report

"""`angelspec suite`: every method side by side, per domain, in one run; JSON, Markdown, PNG plots, BENCHMARKS.md.

Domains: Spec-Bench's six categories (its multi-turn category is MT-bench's 80 questions; first turns are used),
GSM8K test and MBPP test, prompts spread evenly over each domain. Methods through `generate()`: AR (the baseline of
every ratio), transformers' prompt lookup decoding and each shipped drafter with D-cut (MTP, DFly, its DFlash
ablation, the training-free suffix drafter, and the router over MTP + DFly + suffix); `--ablations` adds MTP without
TTT, transformers' built-in DFlash generator on the DFlash checkpoint and transformers' assisted generation with its
heuristic schedule on an early-exit assistant (the target's first quarter of layers). Then the batched engine:
batched AR vs MTP, DFly, the suffix drafter and the router at constant depths and with D-cut, over concurrencies, on
the chat+math+code mix. A method that fails (for example a drafter for another target) is reported with its error;
the rest of the suite runs.

Each finished domain and the engine run are kept under `<output-dir>/parts/`, and the report is rewritten after each:
a run cut off resumes where it stopped when the same command is run again (a part is measured again when the size,
the methods, the package's code or a drafter's weights changed, or with `--fresh`). Every ratio compares methods
within one domain's run, AR included.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import statistics
from dataclasses import dataclass

from transformers.utils import logging

from ..hub import load_drafter
from .bench import (
    Method,
    assisted_heuristic_method,
    code_fingerprint,
    drafter_methods,
    machine_state,
    markdown_table,
    method_row,
    method_table_header,
    prompt_lookup_method,
    run_benchmark,
)
from .engine_bench import format_engine_table, run_engine_benchmark


logger = logging.get_logger(__name__)

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
ABLATION_KINDS = ("mtp-no-ttt",)  # drafters measured only with --ablations

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
FULL = SuiteSize(  # issue 35's size: about two hours on 2 CPU cores (default threads), resumable per domain
    16,
    128,
    (1, 4, 16),
    48,
    {
        "mtp": ("constant-1", "dcut"),
        "dfly": ("constant-2", "dcut"),
        "suffix": ("dcut",),
        "router": ("dcut",),
    },
    1,
    engine_requests=16,
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


def domain_or_set_prompts(name: str, limit: int, data_dir: str | None = None) -> list[str]:
    """A Spec-Bench domain's `limit` prompts as the suite spreads them (`domain_prompts`), else the first `limit` of
    the prompt set `name` (what the benchmark scripts take as their prompts argument)."""
    from ..prompts import load_prompts

    if name in SPEC_BENCH_CATEGORIES:
        return domain_prompts(limit, data_dir)[name]
    return [row["prompt"] for row in load_prompts(name, data_dir=data_dir, limit=limit)]


def suite_methods(target, drafters_dir: str, ablations: bool = False) -> tuple[list[Method], dict]:
    """The generate() methods (each drafter with D-cut) and the loaded drafters by kind; a drafter that cannot be
    loaded becomes a failed method."""
    methods, loaded = [prompt_lookup_method(3)], {}
    if ablations:
        layers = target.model.config.get_text_config().num_hidden_layers
        methods.append(assisted_heuristic_method(target.model, max(1, layers // EARLY_EXIT_FRACTION)))
    for kind, card in DRAFTER_CARDS.items():
        if kind in ABLATION_KINDS and not ablations:
            continue
        path = os.path.join(drafters_dir, card)
        try:
            drafter = load_drafter(path, target.model, target.tokenizer)
        except (OSError, ValueError) as error:
            methods.append(Method(f"{kind}:{card}", error=f"{type(error).__name__}: {error}"))
            continue
        loaded[kind] = drafter
        drafted = drafter_methods(card, drafter, schedules=("dcut",))
        methods += drafted if ablations else [method for method in drafted if method.drafter is not None]
    return methods, loaded


def drafter_fingerprint(drafter) -> str:
    """A digest of a drafter's configuration and every tensor it holds (weights, a suffix drafter's index)."""
    digest = hashlib.sha256(drafter.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(drafter.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class SuiteParts:
    """The suite's finished parts (each domain, and the engine) as JSON files under `<output_dir>/parts/`, so that a
    run cut off resumes where it stopped. A part is kept while `key` (size, methods, target, the package's code,
    drafters' digests) is the same as when it was measured."""

    def __init__(self, output_dir: str, key: dict, fresh: bool = False):
        self.directory = os.path.join(output_dir, "parts")
        self.key = json.loads(json.dumps(key))  # as it reads back (tuples become lists)
        self.fresh = fresh

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.json")

    def load(self, name: str) -> dict | None:
        path = self._path(name)
        if self.fresh or not os.path.isfile(path):
            return None
        try:
            with open(path) as handle:
                saved = json.load(handle)
        except (OSError, ValueError) as error:
            logger.warning(f"{path} is unreadable ({error}); measuring {name} again")
            return None
        saved_key = saved.get("key") if isinstance(saved.get("key"), dict) else {}
        changed = [entry for entry in self.key if saved_key.get(entry) != self.key[entry]]
        if changed:
            if "drafters" in changed:
                drafters = saved_key.get("drafters") or {}
                changed.remove("drafters")
                changed += [
                    f"drafter {kind}" for kind, digest in self.key["drafters"].items() if drafters.get(kind) != digest
                ]
            logger.warning(f"{path} was measured with another {', '.join(changed)}; measuring {name} again")
            return None
        return saved["result"]

    def save(self, name: str, result: dict) -> None:
        """Write atomically: a run cut off mid-write leaves the previous part, never half a file."""
        os.makedirs(self.directory, exist_ok=True)
        temporary = self._path(name) + ".tmp"
        with open(temporary, "w") as handle:
            json.dump({"key": self.key, "result": result}, handle, indent=1)
        os.replace(temporary, self._path(name))


def run_suite(
    target,
    size: SuiteSize,
    drafters_dir: str,
    output_dir: str,
    data_dir: str | None = None,
    ablations: bool = False,
    fresh: bool = False,
    on_part=lambda report: None,
) -> dict:
    """Run the whole suite, skipping the parts already measured under `output_dir` (`SuiteParts`); `on_part` gets
    the report so far after each part. Returns the JSON-ready report."""
    methods, loaded = suite_methods(target, drafters_dir, ablations)
    engine_drafters = [
        (kind, loaded[kind], size.engine_policies[kind]) for kind in size.engine_policies if kind in loaded
    ]
    size_record = {key: (list(value) if isinstance(value, tuple) else value) for key, value in size.__dict__.items()}
    parts = SuiteParts(
        output_dir,
        {
            "size": size_record,
            "target": getattr(target.model.config, "name_or_path", None),
            "methods": [method.name for method in methods],
            "code": code_fingerprint(),
            "drafters": {kind: drafter_fingerprint(drafter) for kind, drafter in loaded.items()},
        },
        fresh,
    )
    domains = domain_prompts(size.prompts_per_domain, data_dir, size.shortest)
    report = {
        "machine": machine_state(),
        "size": size_record,
        "domains": {},
        "summary": {},
        "engine": None,
        "pending": [*domains, "engine"],
    }
    warm_up = True  # the first part measured in this process warms every method up
    for domain, prompts in domains.items():
        result = parts.load(domain)
        if result is None:
            result = run_benchmark(
                target.model,
                target.tokenizer,
                methods,
                prompts,
                size.max_new_tokens,
                repeats=size.repeats,
                warm_up=warm_up,
            )
            result["finished"] = utc_now()
            parts.save(domain, result)
            warm_up = False
        report["domains"][domain] = result
        report["summary"] = summarize_domains(report["domains"])
        report["pending"].remove(domain)
        on_part(report)
    engine = parts.load("engine")
    if engine is None:
        from ..prompts import load_prompts

        mixed = load_prompts("mixed", data_dir=data_dir, limit=max(max(size.concurrencies), size.engine_requests))
        engine = run_engine_benchmark(
            target.model,
            target.tokenizer,
            engine_drafters,
            mixed["prompt"],
            list(size.concurrencies),
            size.engine_max_new_tokens,
            min_requests=size.engine_requests,
            repeats=size.engine_repeats,
        )
        engine["finished"] = utc_now()
        parts.save("engine", engine)
    report["engine"] = engine
    report["pending"].remove("engine")
    on_part(report)
    return report


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


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

    if report["engine"] is not None:
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
        "Every number on this page comes from one command"
        + (f", `{command}`" if command else " (`angelspec suite`)")
        + ", which writes this page, `results.json` and the plots beside it, and the suite section of each model "
        "card; rerun it to regenerate the page (a run cut off resumes at the next unmeasured domain). Earlier "
        "measurements, and how the numbers got here, are in [docs/experiments.md](docs/experiments.md).",
        "",
        f"Machine: {machine['cpu_count']} CPUs, {machine['threads']} torch threads, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, {machine['processor'] or machine['platform']}. "
        f"{size['prompts_per_domain']} prompts per domain, {size['max_new_tokens']} new tokens, greedy, the target in "
        "its own precision; every speculative output is checked against AR's, and every method runs in the same "
        f"process as AR, prompt by prompt. Times are medians of {size['repeats']} run(s) of each generation. τ is "
        "tokens per target forward (the bonus token included). The time split is drafting / target forwards / the "
        "rest (a dash: transformers' own drafters are not timed apart, their drafting is in the rest); round ms is the "
        "median round's target forward / drafting / rest.",
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
        *(
            [
                f"**Incomplete**: still to measure: {', '.join(report['pending'])}. The same command resumes there "
                "(and draws the plots when complete).",
                "",
            ]
            if report.get("pending")
            else []
        ),
        "## Speedup over AR per domain (τ in brackets)",
        "",
        summary_table(report),
        "",
    ]
    parts += [f"![{os.path.basename(p)}]({os.path.relpath(p, relative_to)})" for p in plots]
    for domain, result in report["domains"].items():
        parts += ["", f"## {domain}", "", _measured_on(result, machine), "", markdown_table(result)]
    engine = report["engine"]
    if engine is not None:
        parts += [
            "",
            "## Batched engine (chat + math + code mix)",
            "",
            _measured_on(engine, machine),
            "",
            f"{engine['max_new_tokens']} new tokens per request; tokens/s is the median of {engine.get('repeats', 1)} "
            "run(s) of each method, the methods taking turns.",
            "",
            format_engine_table(engine),
        ]
    return "\n".join(parts) + "\n"


def _measured_on(result: dict, machine: dict) -> str:
    """When a part was measured, and on what, where that differs from the page's machine."""
    line = f"Measured {result.get('finished', 'before parts were dated')}"
    theirs = result.get("machine", machine)
    if theirs != machine:
        line += (
            f" on another machine: {theirs['cpu_count']} CPUs, {theirs['threads']} threads, torch {theirs['torch']}, "
            f"transformers {theirs['transformers']}"
        )
    return line + "."


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
        lines += [method_row(method, domain) for method in result["methods"] if _card_of(method["name"]) == card]
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


def _card_of(method_name: str) -> str:
    """The card of a method named "kind:card[schedule]" ("" for AR and transformers' own methods without one)."""
    return method_name.partition(":")[2].partition("[")[0]


def update_model_cards(report: dict, drafters_dir: str) -> list[str]:
    """Rewrite (or append) the suite section of each shipped drafter's README.md that the run measured (a card left
    out, e.g. an ablation without `--ablations`, keeps its section); the rest of the card is kept."""
    updated = []
    measured = {_card_of(method["name"]) for result in report["domains"].values() for method in result["methods"]}
    for kind, card in DRAFTER_CARDS.items():
        path = os.path.join(drafters_dir, card, "README.md")
        if not os.path.isfile(path) or card not in measured:
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
    markdown_path = args.benchmarks_md or os.path.join(args.output_dir, "RESULTS.md")
    command = getattr(args, "command_line", None)

    def write(report: dict) -> None:
        report["command"] = command
        report["size_name"] = "quick" if args.quick else "full"
        os.makedirs(args.output_dir, exist_ok=True)
        temporary = os.path.join(args.output_dir, "results.json.tmp")
        with open(temporary, "w") as handle:
            json.dump(report, handle, indent=2)
        os.replace(temporary, os.path.join(args.output_dir, "results.json"))
        # drawn once the suite is complete (each domain's median bar needs every domain); until then the page is
        # marked incomplete, its tables current
        plots = [] if report["pending"] else write_plots(report, args.output_dir)
        with open(markdown_path, "w") as handle:
            handle.write(markdown_report(report, plots, os.path.dirname(os.path.abspath(markdown_path)), command))

    report = run_suite(
        target,
        size,
        args.drafters_dir,
        args.output_dir,
        args.data_dir,
        ablations=args.ablations,
        fresh=args.fresh,
        on_part=write,
    )
    print(summary_table(report))
    print(f"\nresults: {args.output_dir}/results.json, report: {markdown_path}")
    if args.update_model_cards:
        for path in update_model_cards(report, args.drafters_dir):
            print(f"model card updated: {path}")
    return report

"""`angelspec bench`: plain greedy decoding vs speculative decoding with each drafter, same prompts, same process.

For every prompt the methods run back to back (AR first), so machine state drifts equally for all of them.
Each method reports τ, acceptance by depth, tokens/s, speedup over AR and the share of prompts whose output is
identical to AR. A divergence is counted as a near-tie when the AR top-2 logit gap at the first differing position
is below `NEAR_TIE_GAP` (fp32 reductions in a different shape may flip such a tie; nothing else may differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
import transformers
from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

from ..acceptance_metric import SpeculativeAcceptance
from ..generation.engine import resident_memory_bytes
from ..generation.measurements import installed_plan
from ..generation.policies import DCut, VerifyPolicy, resolve_policy
from ..generation.session import forget_served_requests, memory_of
from ..generation.timing import ForwardClock, device_clock
from ..generation.verify_cost import load_cost_model
from ..metrics import SpeculationStats, format_round_profile
from ..prompts import encode_chat, load_prompts
from .divergence import divergence
from .engine_bench import main as engine_main


@dataclass
class Method:
    """One way of decoding: extra `generate()` arguments, the drafter whose acceptance statistics it records, and
    the verify policy it runs with (set on the drafter's generation config, where `generate()` reads it)."""

    name: str
    generate_kwargs: dict = field(default_factory=dict)
    drafter: torch.nn.Module | None = None
    policy: VerifyPolicy | None = None
    error: str | None = None  # set when the method could not even be set up (e.g. a drafter for another target)

    def apply_settings(self) -> None:
        if self.policy is not None:
            for key, value in self.policy.generation_settings().items():
                setattr(self.drafter.generation_config, key, value)


@dataclass
class MethodResult:
    name: str
    seconds: float = 0.0
    new_tokens: int = 0
    target_forwards: int = 0
    target_seconds: float = 0.0
    identical: int = 0
    divergences: int = 0
    near_tie_divergences: int = 0
    prompts: int = 0
    peak_rss_bytes: int = 0
    error: str | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    def to_dict(self, ar_tokens_per_s: float) -> dict:
        if self.error is not None:
            return {"name": self.name, "failed": True, "error": self.error}
        tokens_per_s = self.new_tokens / self.seconds if self.seconds else 0.0
        return {
            "name": self.name,
            "tau": self.new_tokens / self.target_forwards if self.target_forwards else 0.0,
            "acceptance_by_depth": self.acceptance_by_depth(),
            "tokens_per_s": tokens_per_s,
            "speedup": tokens_per_s / ar_tokens_per_s if ar_tokens_per_s else 0.0,
            "identical_fraction": self.identical / self.prompts if self.prompts else 0.0,
            "identical": self.identical,
            "draft_fraction": self.stats.draft_seconds / self.seconds if self.seconds else 0.0,
            "time_split": self.time_split(),
            "round_profile": self.stats.round_profile(),
            "divergences": self.divergences,
            "near_tie_divergences": self.near_tie_divergences,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "seconds": self.seconds,
            "prompts": self.prompts,
            "peak_rss_mib": self.peak_rss_bytes / 2**20,
        }

    def acceptance_by_depth(self) -> list[float]:
        return SpeculativeAcceptance().compute(drafted=self.stats.drafted, accepted=self.stats.accepted)[
            "acceptance_by_depth"
        ]

    def time_split(self) -> dict[str, float]:
        """Share of wall time in drafting (by phase where the drafter reports phases), target forwards, the rest."""
        if not self.seconds:
            return {}
        # transformers' own drafters (prompt lookup, assistant models) are not timed apart: their drafting is "other"
        phases = self.stats.phase_seconds or ({"draft": self.stats.draft_seconds} if self.stats.draft_seconds else {})
        split = {name: seconds / self.seconds for name, seconds in phases.items()}
        split["target_forward"] = self.target_seconds / self.seconds
        split["other"] = max(0.0, 1.0 - sum(split.values()))
        return split


def drafter_methods(
    name: str,
    drafter,
    full_vocab_variant: bool = False,
    schedules: tuple[str, ...] = ("dcut",),
    load_another: Callable[[], torch.nn.Module] | None = None,
) -> list[Method]:
    """The methods a drafter takes part in: ours through `generate(assistant_model=...)` with each verify-depth
    schedule, and for the DFlash configuration also transformers' built-in DFlash generator.

    Each schedule after the first drafts with a drafter of its own from `load_another()` (needed with several
    schedules): the methods run back to back on each prompt, so a drafter that learns while serving (the suffix
    index), shared, would draft under the second schedule the answer it recorded under the first, and D-cut's
    calibration would mix the schedules' rounds."""
    if len(schedules) > 1 and load_another is None:
        raise ValueError(f"{name}: several schedules {schedules} need load_another, a drafter of their own each")
    config = drafter.config
    kind = config.drafter_kind
    methods = []
    for own, schedule in zip([drafter] + [load_another() for _ in schedules[1:]], schedules):
        policy = resolve_policy(schedule, own)
        methods.append(Method(f"{kind}:{name}[{policy.label}]", {"assistant_model": own}, own, policy))
    if full_vocab_variant and config.draft_vocab_size:
        full = drafter.with_full_vocabulary()
        policy = methods[0].policy
        methods.append(
            Method(f"{kind}:{name}+full-vocab-head[{policy.label}]", {"assistant_model": full}, full, policy)
        )
    if kind == "dflash":
        builtin = {"assistant_model": drafter.as_transformers_dflash(), "speculation_type": "dflash"}
        methods.append(Method(f"transformers-dflash:{name}", builtin))
    return methods


class TargetForwardMeter(ForwardClock):
    """Counts and times target forwards with hooks, for any method (built-in ones too): τ = new tokens / forwards,
    the verify share of a round, the rounds of a method that does not time its own, and the peak memory in use at
    the end of a forward."""

    def __init__(self, target):
        super().__init__(target)
        self.peak_bytes = 0

    def reset(self) -> None:
        self.spans, self.peak_bytes = [], 0

    @property
    def count(self) -> int:
        return len(self.spans)

    @property
    def seconds(self) -> float:
        return sum(end - start for start, end in self.spans)

    def _after(self, *args) -> None:
        super()._after()
        self.peak_bytes = max(self.peak_bytes, resident_memory_bytes(self.device))  # at the forward's peak

    def round_seconds(self) -> list[tuple[float, float, float]]:
        """(forward, drafting, whole round) seconds of each round after the prefill, a round running from one
        forward's start to the next's, for a method that does not time its rounds itself (plain decoding;
        transformers' own drafters, whose drafting is not timed apart and so counts in the rest)."""
        return [(end - start, 0.0, after - start) for (start, end), (after, _) in zip(self.spans[1:], self.spans[2:])]


def run_benchmark(
    target,
    tokenizer,
    methods: list[Method],
    prompts: list[str],
    max_new_tokens: int,
    repeats: int = 1,
    warm_up: bool = True,
) -> dict:
    """Run AR and every method on `prompts`, back to back per prompt; return the JSON-ready results. With
    `repeats` > 1 each generation is timed that many times and the median time counts."""
    encoded = [torch.tensor([encode_chat(tokenizer, prompt)]) for prompt in prompts]
    methods = [Method("ar")] + methods
    results = {method.name: MethodResult(method.name, error=method.error) for method in methods}
    meter = TargetForwardMeter(target)
    stop = {"max_new_tokens": max_new_tokens, "min_new_tokens": 0, "do_sample": False}
    try:
        if encoded and warm_up:  # first calls pay for allocations and kernel selection
            for method in methods:
                if method.error is None:
                    _guarded(
                        results[method.name],
                        lambda: _run_method(target, method, encoded[0], {"max_new_tokens": 4, "do_sample": False}),
                    )
        for method in methods:  # the measured prompts start from the drafters as loaded, warm-up outputs forgotten
            if method.drafter is not None:
                forget_served_requests(method.drafter)
        for input_ids in tqdm(encoded, desc="bench", unit="prompt"):
            reference = None
            for method in methods:
                result = results[method.name]
                if result.error is not None:
                    continue
                timings = []
                for _ in range(repeats):
                    meter.reset()
                    start = device_clock(target.device)
                    output = _guarded(result, lambda: _run_method(target, method, input_ids, stop))
                    timings.append(device_clock(target.device) - start)
                if output is None:
                    continue
                result.seconds += statistics.median(timings)
                result.target_forwards += meter.count
                result.target_seconds += meter.seconds
                result.peak_rss_bytes = max(result.peak_rss_bytes, meter.peak_bytes)
                result.new_tokens += output.shape[1] - input_ids.shape[1]
                result.prompts += 1
                if method.drafter is not None:  # its rounds timed by its own decoding session
                    result.stats = result.stats + memory_of(method.drafter).stats
                else:
                    result.stats.round_seconds += meter.round_seconds()
                if reference is None:
                    reference = output  # AR runs first
                _compare(result, output, reference, target)
    finally:
        meter.remove()
    ar = results["ar"]
    ar_tokens_per_s = ar.new_tokens / ar.seconds if ar.seconds else 0.0
    plan = installed_plan(target)
    report = {
        "machine": machine_state(),
        "target": getattr(target.config, "name_or_path", None),
        "linear_kernels": {str(rows): choice for rows, choice in sorted(plan.choices.items())} if plan else "default",
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "num_prompts": len(prompts),
        "methods": [result.to_dict(ar_tokens_per_s) for result in results.values()],
    }
    # What D-cut decided with: this machine's verify-cost profile and each adaptive method's calibration.
    adaptive = [
        (entry, method)
        for entry, method in zip(report["methods"], methods)
        if isinstance(method.policy, DCut) and not entry.get("failed")
    ]
    if adaptive:
        report["verify_cost"] = dataclasses.asdict(load_cost_model(target))
    for entry, method in adaptive:
        entry.update(memory_of(method.drafter).estimates.calibrator.report())
    return report


def _run_method(target, method: Method, input_ids: torch.Tensor, generate_kwargs: dict) -> torch.Tensor:
    method.apply_settings()
    return target.generate(input_ids, **generate_kwargs, **method.generate_kwargs)


def _guarded(result: MethodResult, run):
    """Run one generation of a method; a method that raises is marked failed with its error (and skipped from then
    on) while the other methods carry on. AR, the baseline, is not guarded."""
    if result.name == "ar":
        return run()
    try:
        return run()
    except Exception as error:  # any failure of one method must not end the benchmark of the others
        result.error = f"{type(error).__name__}: {error}"
        return None


def _compare(result: MethodResult, output: torch.Tensor, reference: torch.Tensor, target) -> None:
    """Count identical outputs; classify a divergence as a near tie by the AR top-2 gap where it starts."""
    if torch.equal(output, reference):
        result.identical += 1
        return
    result.divergences += 1
    result.near_tie_divergences += divergence(target, [], reference[0].tolist(), output[0].tolist())["near_tie"]


def code_fingerprint() -> str:
    """A digest of the package's Python sources: a part measured by other code (another commit, an edit) is never
    reported as this code's."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, package).encode())
                with open(path, "rb") as handle:
                    digest.update(handle.read())
    return digest.hexdigest()[:16]


def machine_state() -> dict:
    """What the numbers depend on besides the command: the libraries, threads, CPU, and the package's code (where
    it was imported from and a digest of its sources: an A/B of two commits shows which ran)."""
    return {
        "code": code_fingerprint(),
        "package": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": cpu_model() or platform.processor(),
    }


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (`platform.processor()` is empty there), or None."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def format_table(results: dict) -> str:
    header = (
        f"{'method':<40} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'identical':>9} {'draft%':>7} "
        f"{'round ms: target/draft/rest':>27}  acceptance by depth"
    )
    lines = [header, "-" * len(header)]
    for method in results["methods"]:
        if method.get("failed"):
            lines.append(f"{method['name']:<40} FAILED: {method['error']}")
            continue
        depths = " ".join(f"{rate:.2f}" for rate in method["acceptance_by_depth"])
        lines.append(
            f"{method['name']:<40} {method['tau']:>6.2f} {method['tokens_per_s']:>8.2f} {method['speedup']:>7.2f}x "
            f"{method['identical_fraction']:>9.0%} {method.get('draft_fraction', 0):>7.1%} "
            f"{format_round_profile(method.get('round_profile')):>27}  {depths}"
        )
    return "\n".join(lines)


METHOD_COLUMNS = (
    "method",
    "τ",
    "tokens/s",
    "speedup vs AR",
    "identical to AR",
    "divergences (near-tie)",
    "time: draft / target / other",
    "round ms: target / draft / rest",
    "peak RSS MiB",
    "acceptance by depth",
)


def _time_split_cell(split: dict[str, float]) -> str:
    """Percent of wall time drafting (all drafter phases; "—" where drafting is not timed apart), in target forwards,
    and the rest."""
    if not split:
        return "—"
    target, other = split.get("target_forward", 0.0), split.get("other", 0.0)
    drafting = [share for phase, share in split.items() if phase not in ("target_forward", "other")]
    draft = f"{100 * sum(drafting):.0f}" if drafting else "—"
    return f"{draft} / {100 * target:.0f} / {100 * other:.0f} %"


def method_row(method: dict, *leading: str) -> str:
    """One method's Markdown row under `METHOD_COLUMNS` (after any `leading` cells)."""
    if method.get("failed"):
        cells = [method["name"], f"failed: {method['error']}"] + [""] * (len(METHOD_COLUMNS) - 2)
    else:
        cells = [
            method["name"],
            f"{method['tau']:.2f}",
            f"{method['tokens_per_s']:.1f}",
            f"{method['speedup']:.2f}×",
            f"{method['identical']}/{method['prompts']}",
            f"{method['divergences']} ({method['near_tie_divergences']})",
            _time_split_cell(method["time_split"]),
            format_round_profile(method.get("round_profile")),
            f"{method['peak_rss_mib']:.0f}",
            ", ".join(f"{rate:.2f}" for rate in method["acceptance_by_depth"]) or "—",
        ]
    return "| " + " | ".join([*leading, *cells]) + " |"


def method_table_header(*leading: str) -> list[str]:
    columns = [*leading, *METHOD_COLUMNS]
    return ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]


def markdown_table(results: dict) -> str:
    """The results as a Markdown table (model cards and BENCHMARKS.md take their numbers from here)."""
    return "\n".join(method_table_header() + [method_row(method) for method in results["methods"]])


def prompt_lookup_method(num_tokens: int) -> Method:
    """transformers' prompt lookup decoding: drafts copied from n-gram matches in the prompt, no drafter model."""
    return Method(f"prompt-lookup[{num_tokens}]", {"prompt_lookup_num_tokens": num_tokens})


def early_exit_assistant(target, num_layers: int):
    """An assistant model with the target's tokenizer made from the target itself: its first `num_layers` decoder
    layers, final norm and lm_head, weights shared (nothing copied) — the self-speculative "early exit" draft of
    LayerSkip and Draft & Verify, untrained. Offline there is no smaller model of the target's family, so this is
    the compatible assistant that transformers' own assisted generation (`AssistedCandidateGenerator`) can run."""
    import copy

    total = target.config.get_text_config().num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"An early-exit assistant needs 1 to {total - 1} of the target's {total} layers, got {num_layers}"
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        assistant = type(target)(config)
    decoder, source = assistant.get_decoder(), target.get_decoder()
    for name, module in source.named_children():
        setattr(decoder, name, module[:num_layers] if name == "layers" else module)
    assistant.lm_head = target.lm_head
    unset = [name for name, tensor in [*assistant.named_parameters(), *assistant.named_buffers()] if tensor.is_meta]
    if unset:
        raise ValueError(
            f"Early-exit assistant: {type(target).__name__} keeps {unset[:3]} outside its decoder and lm_head"
        )
    assistant.generation_config = copy.deepcopy(target.generation_config)
    return assistant.eval()


def assisted_heuristic_method(target, num_layers: int) -> Method:
    """transformers' assisted generation with its `heuristic` draft-length schedule (and, with scikit-learn
    installed, its tuned confidence threshold) on the early-exit assistant."""
    assistant = early_exit_assistant(target, num_layers)
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    total = target.config.get_text_config().num_hidden_layers
    return Method(f"assisted-heuristic:early-exit-{num_layers}of{total}", {"assistant_model": assistant})


def main(args: argparse.Namespace) -> dict:
    from ..arguments import load_target_from_args
    from ..hub import load_drafter

    target = load_target_from_args(args)
    methods, engine_drafters = [], []
    if args.prompt_lookup:
        methods.append(prompt_lookup_method(args.prompt_lookup))
    if args.early_exit_assistant:
        methods.append(assisted_heuristic_method(target.model, args.early_exit_assistant))
    for spec in args.drafter:
        path, _, own_schedules = spec.partition("@")

        def load(path=path):
            drafter = load_drafter(path, target.model, target.tokenizer)
            if args.num_draft_tokens is not None:
                drafter.generation_config.num_assistant_tokens = args.num_draft_tokens
            return drafter

        try:
            drafter = load()
        except (OSError, ValueError) as error:  # reported as a failed method; the others still run
            methods.append(Method(os.path.basename(os.path.normpath(path)), error=f"{type(error).__name__}: {error}"))
            continue
        schedules = tuple(
            schedule.strip() for schedule in (own_schedules or args.schedules).split(",") if schedule.strip()
        )
        name = os.path.basename(os.path.normpath(path))
        if args.concurrency:
            engine_drafters.append((name, drafter, schedules))
        else:
            methods += drafter_methods(name, drafter, args.full_vocab_variant, schedules, load_another=load)
    prompts = [row["prompt"] for row in load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)]
    if args.concurrency:
        report = engine_main(args, target, engine_drafters, prompts)
        report.update(
            machine=machine_state(), prompts=args.prompts, target=getattr(target.model.config, "name_or_path", None)
        )
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as handle:
                json.dump(report, handle, indent=2)
        return report
    results = run_benchmark(
        target.model, target.tokenizer, methods, prompts, args.max_new_tokens, repeats=args.repeats
    )
    results["prompts"] = args.prompts
    results["command"] = getattr(args, "command_line", None)
    print(format_table(results))
    if args.markdown:
        print("\n" + markdown_table(results))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=2)
    return results

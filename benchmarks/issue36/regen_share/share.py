"""Where sampled regeneration loses to the batched-forward bound: one run of `regenerate_responses` (the target in DTYPE, 48 rows,
temperature 0.8, three seeds per prompt, at most 160 new tokens, the first N MT-Bench-101 first turns), the engine's
own clocks (prefills, target forwards, the rest of each step) read off the run, and the bound at 48 rows and the
responses' mean attended context (measured before the run at 121 tokens, this command's, and after it at the
responses' own), and the batch cache's width against its rows' mean length. With `--cprofile` also
the 25 functions of most own time; with `--max-waste F` the batch cache is compacted once holes are F of its columns
(`RaggedCache.compact`'s default, 0.5 when this was written). With `--probe-every K` the bound is also timed during
the run, every K rounds (3 forwards of 48 rows × 1 token over a 121-token cache of the engine's kind, prefilled once
before the run), its time taken out of the run's: on a machine whose speed drifts by a third within minutes, the
bound of the minutes the run took (the median of the probes), not of the minute before or after it.

    .venv/bin/python benchmarks/issue36/regen_share/share.py 160 float32 [--cprofile] [--max-waste 0.25] [--probe-every 25]
"""

import cProfile
import os
import pstats
import sys
import tempfile
import time

import torch

import angelspec_hf
from angelspec_hf.cache_utils import RaggedCache, growing_cache, with_cache
from angelspec_hf.generation import engine as engine_module
from angelspec_hf.generation.verify_cost import profile_verify_cost
from angelspec_hf.training.regenerate import mean_attended_context, read_responses, regenerate_responses


limit, dtype = int(sys.argv[1]), sys.argv[2]
rows = 48
target = angelspec_hf.load_target("smollm2", dtype=dtype)
engines = []
_init = engine_module.SpeculativeEngine.__init__


def keep(self, *args, **kwargs):  # the run's engine, to read its clocks afterwards
    _init(self, *args, **kwargs)
    engines.append(self)


engine_module.SpeculativeEngine.__init__ = keep
shapes = []  # (rows, cache width, mean row length) at each round
_round = engine_module.SpeculativeEngine._round


def measured_round(self):
    shapes.append((len(self.rows), self.cache.width, float(self.cache.lengths.float().mean())))
    return _round(self)


engine_module.SpeculativeEngine._round = measured_round
probe_every = int(sys.argv[sys.argv.index("--probe-every") + 1]) if "--probe-every" in sys.argv else None
probes, probe_seconds = [], [0.0]  # seconds of one bound forward each; the run's seconds spent probing


class BoundProbe:
    """The bound's forward (48 rows, one new token over 121 tokens of the engine's cache kind), timed on demand."""

    def __init__(self, context: int = 121):
        generator = torch.Generator().manual_seed(0)
        vocab = target.model.config.vocab_size
        self.cache = growing_cache()
        with torch.no_grad():
            target.model(
                input_ids=torch.randint(vocab, (rows, context), generator=generator), **with_cache(self.cache)
            )
        self.new = torch.randint(vocab, (rows, 1), generator=generator)
        self.positions = torch.full((rows, 1), context)

    def time(self, count: int = 3) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(count):
                forward = time.perf_counter()
                target.model(input_ids=self.new, position_ids=self.positions, **with_cache(self.cache))
                probes.append(time.perf_counter() - forward)
                self.cache.crop(-1)
        probe_seconds[0] += time.perf_counter() - start


if probe_every:
    probe = BoundProbe()
    _probed_round = engine_module.SpeculativeEngine._round

    def probed_round(self):
        if len(shapes) % probe_every == 1:
            probe.time()
        return _probed_round(self)

    engine_module.SpeculativeEngine._round = probed_round
if "--max-waste" in sys.argv:
    RaggedCache.compact.__defaults__ = (float(sys.argv[sys.argv.index("--max-waste") + 1]),)
import angelspec_hf.training.regenerate as regenerate_module  # noqa: E402


regenerate_module.SpeculativeEngine = engine_module.SpeculativeEngine
output = os.path.join(tempfile.mkdtemp(), "responses.jsonl.xz")


def bound_now(context: int) -> float:
    """`angelspec regenerate`'s bound: 48 rows, one token, the engine's own cache, the median of 9 forwards."""
    step = profile_verify_cost(
        target.model, rows=[rows], tokens=[1], context=context, repeats=9, progress=False, new_cache=growing_cache
    )
    return rows / step(rows, 1)


before = bound_now(121)  # the mean attended context of this command's responses
profiler = cProfile.Profile() if "--cprofile" in sys.argv else None
start = time.perf_counter()
if profiler:
    profiler.enable()
regenerate_responses(
    target.model,
    target.tokenizer,
    ["mtbench101"],
    output,
    data_dir="../shared/data",
    limit_per_source=limit,
    max_prompt_tokens=256,
    max_new_tokens=160,
    batch_size=rows,
    temperature=0.8,
    seed=[90000, 94000, 98000],
)
if profiler:
    profiler.disable()
seconds = time.perf_counter() - start - probe_seconds[0]
records = read_responses(output)
tokens = sum(len(r["response_ids"]) for r in records)
stats = engines[0].stats
forward = sum(t[0] for t in stats.round_seconds)
steps = sum(t[2] for t in stats.round_seconds)
prefill = stats.phase_seconds["prefill"]
context = mean_attended_context(records)
after = bound_now(context)
print(
    f"code {angelspec_hf.__file__}, {dtype}: {len(records)} responses, {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s"
)
print(
    f"bound at {rows} rows, context {context}, before / after the run: {before:.1f} / {after:.1f} tokens/s -> {tokens / seconds / before:.0%} / {tokens / seconds / after:.0%} of it"
)
print(
    f"rounds {stats.rounds} (mean rows {tokens / max(stats.rounds, 1):.1f}); forwards {forward:.1f} s, rest of the "
    f"rounds {steps - forward - probe_seconds[0]:.1f} s, prefills {prefill:.1f} s ({stats.reused_prefills} reused), "
    f"outside the engine's clocks {seconds - (steps - probe_seconds[0]) - prefill:.1f} s"
)
print(
    f"compaction at {getattr(engine_module, 'COMPACT_AT', RaggedCache.compact.__defaults__[0])} of the columns: mean width "
    f"{sum(s[1] for s in shapes) / len(shapes):.1f} columns over rows {sum(s[2] for s in shapes) / len(shapes):.1f} "
    f"tokens long on average; rounds with 48 rows: {sum(s[0] == rows for s in shapes)} of {len(shapes)}"
)
if probes:
    during = rows / sorted(probes)[len(probes) // 2]
    print(
        f"bound during the run ({len(probes)} probe forwards, {probe_seconds[0]:.1f} s taken out of the run's): "
        f"{during:.1f} tokens/s (forwards {min(probes) * 1000:.0f}-{max(probes) * 1000:.0f} ms) -> "
        f"{tokens / seconds / during:.0%} of it"
    )
if profiler:
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

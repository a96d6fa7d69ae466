"""Routing `generate()` to AngelSpec drafters.

`_get_candidate_generator` in transformers is a fixed if/elif chain with no registry, so `install()` wraps it:
an AngelSpec drafter passed as `assistant_model` gets `AngelSpecCandidateGenerator`; every other call (other
assistants, prompt lookup, `speculation_type="dflash"`, ...) is delegated unchanged to the original method.
`install()` also wraps `_assisted_decoding`, where transformers' draft-verify loop runs: with an AngelSpec drafter, a
batch of sequences runs on the package's batched engine (`engine.py`; transformers' loop decodes one sequence at a
time), and so does one sequence whenever the engine reproduces everything the call asks (`engine_misses`): the same
tokens with a round's own bookkeeping at 1.5-2 ms instead of 2.5-3 (issue 35). A call with a setting only
transformers' loop has (a streamer, stop strings, other logits processors, scores or the cache returned) takes that
loop with `AngelSpecCandidateGenerator`; everything else is delegated unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import MinLengthLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from ..metrics import SpeculationStats
from .candidate_generator import AngelSpecCandidateGenerator
from .engine import Request, SpeculativeEngine


SUPPORTED_TRANSFORMERS = ">=5.23"  # setup.cfg's requirement (a test keeps the two equal)
TESTED_TRANSFORMERS = ("5.23.0", "5.25.0")  # the oldest and newest release `make compat` runs the tests on
# What the wrappers below read of the private methods they wrap (transformers has no registry of candidate generators
# and no hook for batches): checked at import, so that a release that changes them fails here, in one line.
WRAPPED_PARAMETERS = {
    "_get_candidate_generator": ("generation_config", "input_ids", "assistant_model", "target_tokenizer"),
    "_assisted_decoding": (
        "input_ids",
        "logits_processor",
        "stopping_criteria",
        "generation_config",
        "streamer",
        "assistant_model",
        "tokenizer",
        "model_kwargs",
    ),
}


def check_transformers(version: str = transformers.__version__, mixin: type = GenerationMixin) -> None:
    """Refuse, with an `ImportError` naming the supported range, a transformers outside it or whose `GenerationMixin`
    lacks what the routing wraps."""
    problems = [] if SpecifierSet(SUPPORTED_TRANSFORMERS).contains(version, prereleases=True) else ["too old"]
    for name, expected in WRAPPED_PARAMETERS.items():
        method = getattr(mixin, name, None)
        parameters = inspect.signature(method).parameters if callable(method) else {}
        missing = [parameter for parameter in expected if parameter not in parameters]
        if missing:
            problems.append(f"GenerationMixin.{name} " + (f"lacks {', '.join(missing)}" if method else "is gone"))
    if problems:
        raise ImportError(
            f"angelspec_hf routes generate() on transformers {SUPPORTED_TRANSFORMERS} (tested on "
            f"{' and '.join(TESTED_TRANSFORMERS)}); this is transformers {version}: {'; '.join(problems)}"
        )


check_transformers()
_ORIGINAL_GET_CANDIDATE_GENERATOR = GenerationMixin._get_candidate_generator
_SIGNATURE = inspect.signature(_ORIGINAL_GET_CANDIDATE_GENERATOR)
_ORIGINAL_ASSISTED_DECODING = GenerationMixin._assisted_decoding
_ASSISTED_SIGNATURE = inspect.signature(_ORIGINAL_ASSISTED_DECODING)
# What the batched path reproduces of generate(): sampling warpers, the length limit and EOS.
_BATCHED_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
_BATCHED_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


def as_drafter(assistant_model):
    """The AngelSpec drafter `assistant_model` is or wraps (a peft `PeftModel`, whose LoRA layers sit inside the
    drafter's own modules, so the drafter itself drafts with them), else None."""
    # Imported here: the drafter classes install this module's routing when they are imported (`models/__init__`).
    from ..models.base import AngelSpecDrafterPreTrainedModel

    if isinstance(assistant_model, AngelSpecDrafterPreTrainedModel):
        return assistant_model
    get_base_model = getattr(assistant_model, "get_base_model", None)
    base_model = get_base_model() if callable(get_base_model) else None
    return base_model if isinstance(base_model, AngelSpecDrafterPreTrainedModel) else None


@functools.wraps(_ORIGINAL_GET_CANDIDATE_GENERATOR)
def _get_candidate_generator(self, *args, **kwargs):
    arguments = _SIGNATURE.bind(self, *args, **kwargs).arguments
    drafter = as_drafter(arguments.get("assistant_model"))
    generation_config = arguments["generation_config"]
    if drafter is not None and generation_config.speculation_type != "dflash":
        return AngelSpecCandidateGenerator(
            self, drafter, generation_config, arguments["input_ids"], tokenizer=arguments.get("target_tokenizer")
        )
    return _ORIGINAL_GET_CANDIDATE_GENERATOR(self, *args, **kwargs)


def engine_misses(input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, **_) -> list[str]:
    """What of a `generate()` call the batched engine does not reproduce, by name (empty: it decodes the call as
    transformers' loop would). It reproduces greedy and sampling (temperature, top-k, top-p), the length limit and
    EOS; a minimum length the prompt already reaches (`min_new_tokens=0`) constrains nothing. A cache passed in
    (`past_key_values`) is neither read nor extended: the engine decodes the whole `input_ids` (transformers' 5.23
    assisted loop, prompt lookup's too, decodes other tokens than plain `generate()` from a prefilled cache)."""
    prompt_length = input_ids.shape[1]
    misses = [
        type(processor).__name__
        for processor in logits_processor
        if not isinstance(processor, _BATCHED_PROCESSORS)
        and not (isinstance(processor, MinLengthLogitsProcessor) and processor.min_length <= prompt_length)
    ]
    misses += [type(c).__name__ for c in stopping_criteria if not isinstance(c, _BATCHED_CRITERIA)]
    misses += [
        name
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        if getattr(generation_config, name, False)
    ]
    if streamer is not None:
        misses.append("streamer")
    if input_ids.shape[0] == 1 and generation_config.return_dict_in_generate:  # only transformers' loop returns
        misses.append("return_dict_in_generate (its past_key_values)")  # the cache to a single sequence's caller
    return misses


def runs_on_engine(arguments: dict) -> bool:
    """Whether an AngelSpec drafter's `_assisted_decoding` call (its bound `arguments`) runs on the batched engine:
    a batch always (it refuses what it cannot reproduce), one sequence when the engine reproduces the whole call."""
    return arguments["input_ids"].shape[0] > 1 or not engine_misses(**arguments)


@functools.wraps(_ORIGINAL_ASSISTED_DECODING)
def _assisted_decoding(self, *args, **kwargs):
    arguments = _ASSISTED_SIGNATURE.bind(self, *args, **kwargs).arguments
    drafter, input_ids = as_drafter(arguments.get("assistant_model")), arguments["input_ids"]
    if drafter is not None and runs_on_engine(arguments):
        return batched_speculative_decoding(
            self, drafter, **{k: v for k, v in arguments.items() if k not in ("self", "assistant_model")}
        )
    result = _ORIGINAL_ASSISTED_DECODING(self, *args, **kwargs)
    if drafter is not None:  # the batched engine tells the drafter itself
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        drafter.record_output(sequences[0, input_ids.shape[1] :].tolist())
    return result


def batched_speculative_decoding(
    target,
    drafter,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    streamer=None,
    tokenizer=None,
    model_kwargs=None,
    **_,
):
    """`generate(ids, assistant_model=drafter)` on the batched engine: each row (its padding dropped by
    `attention_mask`) is a request of `SpeculativeEngine`, with the generation config's length limit, EOS and
    sampling settings and the drafter's verify policy (its `num_assistant_tokens_schedule`). Returns the rows, left
    as given, followed by their new tokens, right-padded with `pad_token_id` as `generate()` does."""
    model_kwargs = model_kwargs or {}
    misses = engine_misses(input_ids, logits_processor, stopping_criteria, generation_config, streamer)
    if misses:
        raise ValueError(
            f"Batched speculative decoding ({input_ids.shape[0]} sequences) supports greedy and sampling (temperature, "
            f"top-k, top-p) with max length and EOS; not: {', '.join(misses)}. Call generate() once per sequence."
        )
    attention_mask = model_kwargs.get("attention_mask")
    rows = [ids[attention_mask[r].bool()] if attention_mask is not None else ids for r, ids in enumerate(input_ids)]
    eos = generation_config.eos_token_id
    requests = [
        Request(
            row.tolist(),
            max_new_tokens=generation_config.max_length - input_ids.shape[1],
            eos_token_id=eos if eos is not None else [],
            do_sample=bool(generation_config.do_sample),
            temperature=generation_config.temperature or 1.0,
            top_k=generation_config.top_k,
            top_p=generation_config.top_p,
            seed=int(torch.randint(2**62, ())),
        )
        for row in rows
    ]
    engine = SpeculativeEngine(  # the drafter's policy; past the context as plain generate() goes
        target, drafter, max_batch_size=len(requests), tokenizer=tokenizer, past_context=True
    )
    outputs = engine.generate(requests)
    errors = [output.error for output in outputs if output.error]
    if errors:
        raise ValueError("; ".join(errors))
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    longest = max(len(output.output_ids) for output in outputs)
    sequences = torch.full(
        (len(rows), input_ids.shape[1] + longest), pad, dtype=input_ids.dtype, device=input_ids.device
    )
    sequences[:, : input_ids.shape[1]] = input_ids
    for r, output in enumerate(outputs):
        sequences[r, input_ids.shape[1] : input_ids.shape[1] + len(output.output_ids)] = torch.tensor(
            output.output_ids
        )
    pooled = SpeculationStats()
    for output in outputs:  # each row's prefill first, a forward with no drafts, as transformers' loop counts it
        pooled = pooled + SpeculationStats(drafted=[0], accepted=[0]) + output.stats
    pooled.draft_seconds = engine.stats.drafting.draft_seconds
    pooled.phase_seconds = dict(engine.stats.drafting.phase_seconds)
    pooled.round_seconds = engine.stats.round_seconds  # the batch's rounds, shared by its rows
    engine.session.report(pooled)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def install() -> None:
    """Route AngelSpec drafters passed to `generate(assistant_model=...)` to the batched engine, or where a call
    needs transformers' loop, to our candidate generator (idempotent)."""
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._assisted_decoding = _assisted_decoding


def speculative_generate(
    model, input_ids, logits_processor, stopping_criteria, generation_config, drafter=None, **model_kwargs
):
    """`custom_generate` entry point: `target.generate(ids, custom_generate=speculative_generate, drafter=drafter)`,
    routed as `assistant_model=drafter` is (the engine, or transformers' loop), so the results are the same."""
    if drafter is None:
        raise ValueError(
            "speculative_generate needs a drafter: generate(..., custom_generate=speculative_generate, drafter=drafter)"
        )
    return model._assisted_decoding(
        input_ids, logits_processor, stopping_criteria, generation_config, assistant_model=drafter, **model_kwargs
    )

"""Routing `generate()` to AngelSpec drafters.

`_get_candidate_generator` in transformers is a fixed if/elif chain with no registry, so `install()` wraps it:
an AngelSpec drafter passed as `assistant_model` gets `AngelSpecCandidateGenerator`; every other call (other
assistants, prompt lookup, `speculation_type="dflash"`, ...) is delegated unchanged to the original method.
"""

from __future__ import annotations

import functools
import inspect

from transformers.generation.utils import GenerationMixin

from ..models.base import AngelSpecDrafterPreTrainedModel
from .candidate_generator import AngelSpecCandidateGenerator

_ORIGINAL_GET_CANDIDATE_GENERATOR = GenerationMixin._get_candidate_generator
_SIGNATURE = inspect.signature(_ORIGINAL_GET_CANDIDATE_GENERATOR)


@functools.wraps(_ORIGINAL_GET_CANDIDATE_GENERATOR)
def _get_candidate_generator(self, *args, **kwargs):
    arguments = _SIGNATURE.bind(self, *args, **kwargs).arguments
    drafter = arguments.get("assistant_model")
    generation_config = arguments["generation_config"]
    if isinstance(drafter, AngelSpecDrafterPreTrainedModel) and generation_config.speculation_type != "dflash":
        return AngelSpecCandidateGenerator(
            self, drafter, generation_config, arguments["input_ids"], tokenizer=arguments.get("target_tokenizer")
        )
    return _ORIGINAL_GET_CANDIDATE_GENERATOR(self, *args, **kwargs)


def install() -> None:
    """Route AngelSpec drafters passed to `generate(assistant_model=...)` to our candidate generator (idempotent)."""
    GenerationMixin._get_candidate_generator = _get_candidate_generator


def speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, drafter=None, **model_kwargs):
    """`custom_generate` entry point: `target.generate(ids, custom_generate=speculative_generate, drafter=drafter)`.

    Runs transformers' own assisted-decoding loop with the drafter, so results equal `assistant_model=drafter`.
    """
    if drafter is None:
        raise ValueError("speculative_generate needs a drafter: generate(..., custom_generate=speculative_generate, drafter=drafter)")
    return model._assisted_decoding(
        input_ids, logits_processor, stopping_criteria, generation_config, assistant_model=drafter, **model_kwargs
    )

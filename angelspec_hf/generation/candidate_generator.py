"""The candidate generator that plugs AngelSpec drafters into transformers' loop, for the single-sequence
`target.generate(assistant_model=drafter)` calls the batched engine does not reproduce (`speculative.engine_misses`).

transformers' `_assisted_decoding` owns the draft-verify loop (verification, rejection sampling, cache crop, EOS,
stopping criteria, streamer); this generator only drafts. It declares `requires_model_outputs`, so every call gets
the previous target forward, whose hidden states (the indices the drafter asks for, no extra compute) condition
the next draft.

How many tokens are drafted and verified is the drafter's verify policy (`policies.py`), chosen from its generation
config as transformers' assistants choose theirs: `num_assistant_tokens_schedule` `"dcut"` (default), `"constant"`
or `"heuristic"`, with `num_assistant_tokens` the most drafted per round. Unlike transformers' assistants,
`assistant_confidence_threshold` is not used: D-cut's calibrated prefix confidences take its place.
"""

from __future__ import annotations

import time
import weakref

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.utils import logging

from .session import DecodingSession
from .target_states import TargetStateTaps
from .timing import ForwardClock


logger = logging.get_logger(__name__)


class AngelSpecCandidateGenerator(CandidateGenerator):
    """Drafts with an AngelSpec drafter bound to the target, as its verify policy decides.

    Bookkeeping: the target forward of each round starts at the first position without a target hidden state, so
    the first `len(input_ids) - 1 - num_seen` rows of its hidden states are the newly verified ones. A round the
    policy skips leaves them pending; the drafter reads them all when it next drafts.
    """

    requires_model_outputs = True

    def __init__(self, target, drafter, generation_config, input_ids: torch.LongTensor, tokenizer=None):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"AngelSpecCandidateGenerator decodes one sequence, got a batch of {input_ids.shape[0]}: batches run "
                "on angelspec_hf.SpeculativeEngine (generate() routes them there after `import angelspec_hf`)."
            )
        if input_ids.shape[1] == 0:
            raise ValueError("Empty prompt: speculative decoding needs at least one input token.")
        drafter.bind_target(target, tokenizer)
        self.drafter = drafter
        self.taps = TargetStateTaps(target, drafter.target_hidden_state_indices())
        # a caller who asked for the hidden states gets them all (the taps read theirs either way)
        self.model_kwargs_overrides = {} if generation_config.output_hidden_states else self.taps.forward_kwargs()
        self.session = DecodingSession(target, drafter)  # the policy from the drafter's generation config
        self.row = self.session.new_row()
        self.max_length = generation_config.max_length
        self.do_sample = generation_config.do_sample
        self.temperature = (generation_config.temperature or 1.0) if self.do_sample else 1.0
        self.stop_strings = (
            StopStringCriteria(tokenizer, generation_config.stop_strings)
            if generation_config.stop_strings and tokenizer is not None
            else None
        )
        self.may_draft = True
        if self.do_sample and self.stop_strings is not None:
            # Cutting before a stop string reads the drafted token, which rejection sampling cannot allow, and nearly
            # any token may complete a stop string: sampling with stop strings decodes without drafts, losslessly.
            logger.warning_once(
                "Sampling with stop_strings: speculative decoding would have to cut drafts by the tokens drawn, which "
                "biases the output; such calls decode without drafts."
            )
            self.may_draft = False
        self.state = drafter.new_draft_state()
        self.num_seen = 0
        self.pending_hidden: tuple[torch.Tensor, ...] = ()
        self.pending_tokens = input_ids[:, :0]
        self.drafting = None  # this round's `DraftRound`, None when it drafted nothing
        self.num_drafted = 0
        # A round runs from one call here to the next: its target forward is timed by hooks, removed once transformers'
        # loop drops this generator (CPython frees it when `generate()` returns), its drafting by the `DraftRound`.
        self.forwards = ForwardClock(target)
        weakref.finalize(self, self.forwards.remove)
        weakref.finalize(self, self.taps.install())  # the drafter's states, hooked on their layers while this lives
        self.round_started: float | None = None

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round drafts: transformers (5.25 on) keeps that many recurrent states of the target's
        cache when `_assisted_decoding` starts recording its past."""
        return self.drafter.generation_config.num_assistant_tokens

    def time_round(self) -> None:
        """Record the round that ends here (`SpeculationStats.round_profile`); the prefill before the first is none."""
        now = time.perf_counter()
        forward = self.forwards.take()
        if self.round_started is not None:
            draft = self.drafting.seconds if self.drafting is not None else 0.0
            self.session.stats.record_round_time(forward, draft, now - self.round_started)
            self.session.observe_forward(1, 1 + self.num_drafted, forward)
        self.round_started = now

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        if is_first_iteration:  # let the target prefill first: its hidden states condition the first draft
            return input_ids, None
        self.time_round()
        length = input_ids.shape[1]
        num_new = length - 1 - self.num_seen
        new_hidden = tuple(state[:, :num_new] for state in self.taps.states(model_outputs))
        if self.pending_hidden:  # rounds without drafts left these unread
            new_hidden = tuple(torch.cat([old, new], 1) for old, new in zip(self.pending_hidden, new_hidden))
        self.pending_hidden = new_hidden
        self.pending_tokens = torch.cat([self.pending_tokens, input_ids[:, self.num_seen + 1 :]], 1)
        self.num_seen = length - 1
        budget = self.max_length - length - 1
        count = (
            self.session.draft_count(self.state, [self.row], budget, self.pending_tokens.tolist())
            if self.may_draft
            else 0
        )
        self.drafting, self.num_drafted = None, 0
        if count == 0:
            return input_ids, None
        temperatures = torch.tensor([self.temperature])
        draft_ids, draft_logits, self.drafting = self.session.draft_round(
            self.state,
            [self.row],
            self.pending_hidden,
            self.pending_tokens,
            count,
            temperatures=temperatures,
            sampled=[self.do_sample],
        )
        self.pending_hidden, self.pending_tokens = (), self.pending_tokens[:, :0]
        draft_ids = draft_ids[:, : self.drafting.usable_steps()[0]]  # a broken drafter's non-finite scores: no draft
        draft_ids = self.cut_before_stop_string(input_ids, draft_ids)
        (self.num_drafted,) = self.session.depths(self.drafting, [draft_ids.shape[1]], [self.row])
        self.session.stats.add_drafting_time(self.drafting)
        candidates = torch.cat([input_ids, draft_ids[:, : self.num_drafted]], dim=1)
        if not self.do_sample or self.num_drafted == 0:
            return candidates, None
        return candidates, self.drafter.to_target_logits(
            draft_logits[:, : self.num_drafted].float() / self.temperature
        )

    def cut_before_stop_string(self, input_ids: torch.LongTensor, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Drop drafts from the first one that would complete a stop string.

        transformers' loop checks stopping criteria only at the end of a round, so a stop string completed inside
        the accepted drafts would be overrun. Cut here, the completing token can only be the round's bonus token,
        the last one, where the loop stops exactly as plain decoding does.
        """
        if self.stop_strings is None:
            return draft_ids
        for count in range(draft_ids.shape[1]):
            if self.stop_strings(torch.cat([input_ids, draft_ids[:, : count + 1]], dim=1), None).any():
                return draft_ids[:, :count]
        return draft_ids

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        num_matches = int(num_matches)
        self.session.stats.record_round(drafted=self.num_drafted, accepted=num_matches)
        if self.drafting is not None:
            self.session.observe(self.state, self.drafting, [self.num_drafted], [num_matches], [self.row])

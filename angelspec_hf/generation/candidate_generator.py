"""The candidate generator that plugs AngelSpec drafters into `target.generate(assistant_model=drafter)`.

transformers' `_assisted_decoding` owns the draft-verify loop (verification, rejection sampling, cache crop, EOS,
stopping criteria, streamer); this generator only drafts. It declares `requires_model_outputs`, so every call gets
the previous target forward, whose hidden states (the indices the drafter asks for, no extra compute) condition
the next draft.

How many drafted tokens go to verification is the drafter's `generation_config.num_assistant_tokens_schedule`:
`"dcut"` (default) verifies the prefix that maximises expected tokens per second under this machine's profiled
verify cost (D-cut, `dcut.py`); `"constant"` verifies `num_assistant_tokens`; `"heuristic"` is transformers' rule
(+2 after a fully accepted round, -1 otherwise), capped at the drafter's D or block. `num_assistant_tokens` is
the most drafted per round. Unlike transformers' assistants, `assistant_confidence_threshold` is not used: D-cut's
calibrated prefix confidences take its place.
"""

from __future__ import annotations

import time
import warnings

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from ..metrics import SpeculationStats
from .dcut import ConfidenceCalibrator, DraftRound, dcut_depths, load_cost_model

SCHEDULES = ("dcut", "constant", "heuristic")


class AngelSpecCandidateGenerator(CandidateGenerator):
    """Drafts `num_assistant_tokens` tokens per round with an AngelSpec drafter bound to the target.

    Bookkeeping: the target forward of each round starts at the first position without a target hidden state, so
    the first `len(input_ids) - 1 - num_seen` rows of its hidden states are the newly verified ones.
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
        context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and generation_config.max_length > context:
            raise ValueError(
                f"Prompt ({input_ids.shape[1]} tokens) plus max_new_tokens needs {generation_config.max_length} "
                f"positions, beyond the target's context of {context}."
            )
        drafter.bind_target(target, tokenizer)
        self.drafter = drafter
        self.hidden_indices = drafter.target_hidden_state_indices()
        self.model_kwargs_overrides = {"output_hidden_states": self.hidden_indices}
        self.max_tokens = int(drafter.generation_config.num_assistant_tokens)
        self.num_tokens = self.max_tokens
        self.schedule = drafter.generation_config.num_assistant_tokens_schedule or "dcut"
        if self.schedule not in SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "dcut":
            cost_model = load_cost_model(target)
            # One-row verify cost by width, looked up (not interpolated) on every drafted token.
            widths = [cost_model(1, width) for width in range(1, self.max_tokens + 2)]
            self.verify_seconds = lambda rows, width: widths[width - 1]
            if getattr(drafter, "dcut_calibrator", None) is None:  # kept across calls: it follows acceptance drift
                drafter.dcut_calibrator = ConfidenceCalibrator()
            self.calibrator = drafter.dcut_calibrator
        self.max_length = generation_config.max_length
        self.do_sample = generation_config.do_sample
        self.temperature = (generation_config.temperature or 1.0) if self.do_sample else 1.0
        self.stop_strings = (
            StopStringCriteria(tokenizer, generation_config.stop_strings)
            if generation_config.stop_strings and tokenizer is not None
            else None
        )
        if self.do_sample and self.stop_strings is not None:
            # Cutting before a stop string reads the drafted token, which rejection sampling cannot allow, and nearly
            # any token may complete a stop string: sampling with stop strings decodes without drafts, losslessly.
            warnings.warn(
                "Sampling with stop_strings: speculative decoding would have to cut drafts by the tokens drawn, which "
                "biases the output; this call decodes without drafts.", UserWarning, stacklevel=2,
            )
            self.max_tokens = self.num_tokens = 0
        self.state = drafter.new_draft_state()
        self.num_seen = 0
        self.num_drafted = 0
        self.drafting = self.new_round()
        self.step_seconds = 0.0  # one sequential drafting step, measured (optimistic 0 until measured)
        self.verified_confidence = torch.zeros(0)
        self.stats = SpeculationStats()
        drafter.speculation_stats = self.stats

    def new_round(self) -> DraftRound:
        """Greedy: argmax. Sampling: draw from q = softmax(logits / T), the q reported to rejection sampling."""
        return DraftRound(torch.tensor([self.temperature]), sampled=[self.do_sample])

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        if is_first_iteration:  # let the target prefill first: its hidden states condition the first draft
            return input_ids, None
        length = input_ids.shape[1]
        num_new = length - 1 - self.num_seen
        hidden = tuple(model_outputs.hidden_states[i][:, :num_new] for i in self.hidden_indices)
        new_tokens = input_ids[:, self.num_seen + 1 :]
        self.num_seen = length - 1
        self.num_drafted = max(0, min(self.num_tokens, self.max_length - length - 1))
        self.drafting = self.new_round()
        draft_ids, draft_logits = self.drafter.propose(
            self.state, hidden, new_tokens, self.num_drafted, self.drafting.choose, keep_drafting=self.keep_drafting
        )
        draft_ids = draft_ids[:, : self.drafting.usable_steps()[0]]  # a broken drafter's non-finite scores: no draft
        draft_ids = self.cut_before_stop_string(input_ids, draft_ids)
        if self.schedule == "dcut":
            draft_ids = self.dcut(draft_ids, draft_seconds=time.perf_counter() - self.drafting.start)
        self.stats.draft_seconds += time.perf_counter() - self.drafting.start
        self.stats.phase_seconds = dict(getattr(self.state, "phase_seconds", {}))
        draft_logits = draft_logits[:, : draft_ids.shape[1]]
        self.num_drafted = draft_ids.shape[1]
        candidates = torch.cat([input_ids, draft_ids], dim=1)
        if not self.do_sample or self.num_drafted == 0:
            return candidates, None
        return candidates, self.drafter.to_target_logits(draft_logits.float() / self.temperature)

    def keep_drafting(self) -> bool:
        """Early exit for sequential drafting (MTP depths, DFly's AR head) under D-cut: stop once no further token
        can raise the round's expected tokens per second (`worth_drafting_further`, one row)."""
        if self.schedule != "dcut":
            return True
        self.step_seconds = self.drafting.step_seconds(self.step_seconds)
        return self.drafting.worth_continuing(self.calibrator, self.verify_seconds, self.num_drafted, self.step_seconds)

    def dcut(self, draft_ids: torch.LongTensor, draft_seconds: float) -> torch.LongTensor:
        """Keep the prefix worth verifying (D-cut with one request): calibrated prefix confidences against the
        profiled verify cost, this round's drafting time included."""
        count = draft_ids.shape[1]
        if count == 0:
            self.verified_confidence = torch.zeros(0)
            return draft_ids
        raw = self.drafting.confidence()[0, :count]
        depth = dcut_depths([self.calibrator(raw)], self.verify_seconds, draft_seconds, sampled=[self.do_sample])[0]
        self.verified_confidence = raw[:depth]
        return draft_ids[:, :depth]

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
        self.stats.record_round(drafted=self.num_drafted, accepted=num_matches)
        if self.schedule == "dcut" and self.num_drafted:
            self.calibrator.update(self.verified_confidence, torch.arange(self.num_drafted) < num_matches)
        elif self.schedule == "heuristic":  # transformers' rule for assistant models
            all_accepted = num_matches == self.num_drafted
            self.num_tokens = min(self.max_tokens, self.num_tokens + 2) if all_accepted else max(1, self.num_tokens - 1)

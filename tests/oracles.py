"""Test drafters: the real drafting and cache bookkeeping of MTP and DFly, with the drafts steered.

Oracles make a random number of each round's drafts correct, so rounds end with full, partial and no acceptance
(`SoloOracle` for `generate()`, one sequence; `BatchOracle` for the engine, per row). `FixedLawDrafting` draws every
draft from one fixed law, for sampling-distribution tests.
"""

import random

import torch

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter


class SoloOracle:
    """Mixin for `generate()`: after drafting, a random number of the drafts become the `reference` continuation
    [1, T]. Verifies every draft (the `constant` policy) unless a test picks another; `random_confidence` also gives
    each drafted token a random draft probability, so D-cut cuts drafts at varied depths."""

    reference: torch.Tensor
    rng: random.Random
    last_state = None
    random_confidence = False

    def __init__(self, config):
        super().__init__(config)
        self.generation_config.num_assistant_tokens_schedule = "constant"

    def propose(self, state, target_hidden, new_token_ids, num_tokens, choose, keep_drafting=None, new_lengths=None):
        if self.random_confidence:  # the drafting round records a random draft probability for each chosen token
            drafting, real_choose = choose, choose

            def choose(logits):
                token = real_choose(logits)
                drafting.probabilities[-1] = drafting.known_before[-1] = torch.tensor([self.rng.uniform(0.3, 1.0)])
                return token

        draft_ids, draft_logits = super().propose(
            state, target_hidden, new_token_ids, num_tokens, choose, keep_drafting, new_lengths
        )
        self.last_state = state
        length = state.num_committed + 1
        correct = self.reference[0, length : length + self.rng.randint(0, draft_ids.shape[1])]
        draft_ids[0, : correct.numel()] = correct
        return draft_ids, draft_logits


class BatchOracle:
    """Mixin for the engine: after the real batched drafting, a random number of each row's drafts become that row's
    solo reference continuation (`references[request_id]`), so rows accept different numbers of tokens every round."""

    references: dict
    engine = None
    rng: random.Random

    def propose(self, state, target_hidden, new_token_ids, num_tokens, choose, keep_drafting=None, new_lengths=None):
        draft_ids, draft_logits = super().propose(
            state, target_hidden, new_token_ids, num_tokens, choose, keep_drafting, new_lengths
        )
        for r, row in enumerate(self.engine.rows):
            done = len(row.output.output_ids)
            correct = self.references[row.request.request_id][done : done + self.rng.randint(0, draft_ids.shape[1])]
            draft_ids[r, : len(correct)] = torch.tensor(correct, dtype=draft_ids.dtype)
        return draft_ids, draft_logits


class FixedLawDrafting:
    """Mixin: the drafter runs as usual (caches, depths, AR head) but drafts every token from one fixed law q over its
    draft vocabulary, q(x) = 0.7 for one token and 0.1 for the others. Under a steep verify cost a cut that read the
    drafted token would verify the first draft only when it is the likely token (0.7 > 0.5), biasing the output;
    D-cut's E[q] = Σ q² = 0.52 verifies it whatever was drawn."""

    law = torch.tensor([0.7, 0.1, 0.1, 0.1])

    def propose(self, state, target_hidden, new_token_ids, num_tokens, choose, keep_drafting=None, new_lengths=None):
        def fixed(logits):
            return self.law.log().to(logits).expand_as(logits)

        draft_ids, draft_logits = super().propose(
            state,
            target_hidden,
            new_token_ids,
            num_tokens,
            lambda logits: choose(fixed(logits)),
            keep_drafting,
            new_lengths,
        )
        return draft_ids, fixed(draft_logits).clone()


class OracleMTPDrafter(SoloOracle, AngelSpecMTPDrafter):
    pass


class OracleDFlyDrafter(SoloOracle, DFlyDrafter):
    pass


class BatchOracleMTP(BatchOracle, AngelSpecMTPDrafter):
    pass


class BatchOracleDFly(BatchOracle, DFlyDrafter):
    pass


class FixedLawMTP(FixedLawDrafting, AngelSpecMTPDrafter):
    pass


class FixedLawDFly(FixedLawDrafting, DFlyDrafter):
    pass

"""Configuration of the suffix drafter: drafts from earlier occurrences of the context's suffix, with no weights."""

from __future__ import annotations

from .base import AngelSpecDrafterConfig, check_int


class SuffixDrafterConfig(AngelSpecDrafterConfig):
    r"""
    A training-free drafter (as SuffixDecoding, arXiv 2411.04975): each row's context suffix is matched against the
    request's own tokens (prompt and output) and a shared index of the target's earlier outputs, and the draft
    follows what came after the longest match.

    Args:
        num_draft_tokens (`int`, defaults to 8):
            Tokens drafted per round unless the generation config's `num_assistant_tokens` says otherwise.
        min_match_length (`int`, defaults to 1):
            Shortest context suffix (in tokens) that may draft; a row with a shorter match drafts nothing usable.
            One token, as prompt lookup's last resort: D-cut's calibration of λ = ℓ / (ℓ + 1) keeps the drafts of
            short matches it finds unreliable unverified (on Spec-Bench QA, 1 instead of 2 gave τ 1.62 against 1.44).
        max_match_length (`int`, defaults to 32):
            Longest context suffix compared (longer matches count as this long).
        max_candidates (`int`, defaults to 32):
            Most earlier occurrences of the context's last `min_match_length` tokens compared per step (the most
            recent ones), bounding the drafting time per token.
        shared_index_max_tokens (`int`, defaults to 262144):
            Most tokens of earlier outputs kept in the shared index (the oldest outputs leave first); 0 keeps none.
        shared_match_margin (`int`, defaults to 1):
            A row drafts from the shared index only where its match there is longer than the one in the request's
            own tokens by more than this many tokens (the request's own text predicts better at the same length).
        shared_index_num_tokens (`int`, defaults to 0):
            Length of the saved shared index (set by `save_pretrained`; the shape of its `shared_tokens` buffer).
    """

    model_type = "angelspec_suffix"
    drafter_kind = "suffix"

    def __init__(
        self,
        num_draft_tokens: int = 8,
        min_match_length: int = 1,
        max_match_length: int = 32,
        max_candidates: int = 32,
        shared_index_max_tokens: int = 262144,
        shared_index_num_tokens: int = 0,
        shared_match_margin: int = 1,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_int("num_draft_tokens", num_draft_tokens)
        check_int("min_match_length", min_match_length)
        check_int("max_match_length", max_match_length, minimum=min_match_length)
        check_int("max_candidates", max_candidates)
        check_int("shared_index_max_tokens", shared_index_max_tokens, minimum=0)
        check_int("shared_index_num_tokens", shared_index_num_tokens, minimum=0)
        self.num_draft_tokens = num_draft_tokens
        self.min_match_length = min_match_length
        self.max_match_length = max_match_length
        self.max_candidates = max_candidates
        self.shared_index_max_tokens = shared_index_max_tokens
        self.shared_index_num_tokens = shared_index_num_tokens
        check_int("shared_match_margin", shared_match_margin, minimum=0)
        self.shared_match_margin = shared_match_margin

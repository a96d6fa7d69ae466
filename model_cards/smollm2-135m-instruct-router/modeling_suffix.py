"""The suffix drafter: drafts what followed earlier occurrences of the context's suffix, with no weights.

Where the output repeats its input or earlier outputs (RAG, summarization, code edits, agent loops), the longest
earlier match of the context's last tokens predicts the next ones well (SuffixDecoding, arXiv 2411.04975; prompt
lookup decoding). Each row matches against its own tokens (prompt and output so far) and a shared index of the
target's earlier outputs (`record_output`, bounded, saved with the drafter). Written by hand because transformers'
prompt lookup drafts only from the prompt, with no draft distribution or confidence, so it can neither sample
losslessly at its best nor be ranked by D-cut.

Draft distribution of a step whose longest match has length ℓ and, among the earlier occurrences matching that
long, next-token counts c(x) out of n:

    q(x) = λ · c(x) / n + (1 − λ) / V,    λ = ℓ / (ℓ + 1)

so a greedy row's confidence (max q) grows with the match length and the agreement of the occurrences, which D-cut
calibrates like any drafter's; a sampled row draws from q and rejection sampling keeps the target's law.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .base import AngelSpecDrafterPreTrainedModel, DraftPredictions
from .configuration_suffix import SuffixDrafterConfig


SEPARATOR = -1  # between two sequences of an index: no match crosses it


class SuffixIndex:
    """A token text with, for each `key_length`-gram, the positions where it ended: finds the longest earlier match
    of a context's suffix and what followed it."""

    def __init__(self, key_length: int, max_match_length: int, max_candidates: int):
        self.key_length, self.max_match_length, self.max_candidates = key_length, max_match_length, max_candidates
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the text and index the n-grams that end in them."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        k = self.key_length
        for end in range(max(start, k - 1), len(self.tokens)):
            key = tuple(self.tokens[end - k + 1 : end + 1])
            if SEPARATOR not in key:
                self.ends.setdefault(key, []).append(end)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Append a whole sequence, kept apart from the text before it."""
        if self.tokens:
            self.extend([SEPARATOR])
        self.extend(tokens)

    def match(self, suffix: Sequence[int]) -> tuple[int, dict[int, int]]:
        """The longest match ℓ (at most `max_match_length`) of the end of `suffix` that has a next token in the text,
        and the next-token counts over the occurrences that match that long; (0, {}) below `key_length`."""
        k = self.key_length
        if len(suffix) < k:
            return 0, {}
        best, counts = 0, {}
        longest = min(len(suffix), self.max_match_length)
        compared = 0
        for end in reversed(self.ends.get(tuple(suffix[-k:]), ())):
            if end + 1 >= len(self.tokens) or self.tokens[end + 1] == SEPARATOR:
                continue  # the context's own end, or a sequence's last token: nothing followed it
            if compared == self.max_candidates:
                break
            compared += 1
            length = k
            while length < longest and end - length >= 0 and self.tokens[end - length] == suffix[-1 - length]:
                length += 1
            token = self.tokens[end + 1]
            if length > best:
                best, counts = length, {token: 1}
            elif length == best:
                counts[token] = counts.get(token, 0) + 1
        return best, counts

    def nbytes(self) -> int:
        """Rough memory held (a Python list slot and an index entry per token)."""
        return 80 * len(self.tokens)


def draft_log_probabilities(length: int, counts: dict[int, int], vocab_size: int) -> torch.Tensor:
    """log q over the vocabulary for a match of `length` with next-token `counts` (the module docstring's q)."""
    weight = length / (length + 1)
    total = sum(counts.values())
    q = torch.full((vocab_size,), (1 - weight) / vocab_size)
    tokens = torch.tensor(list(counts))
    q[tokens] += weight * torch.tensor(list(counts.values()), dtype=q.dtype) / total
    return q.log()


@dataclass
class SuffixDraftState:
    """The suffix drafter's per-generation state: one index per row over its own tokens. Drafts are never indexed,
    so a round has nothing speculative to drop."""

    make_index: Callable[[], SuffixIndex]
    rows: list[SuffixIndex] = field(default_factory=list)

    def select_rows(self, rows: torch.LongTensor) -> None:
        self.rows = [self.rows[r] for r in rows.tolist()]

    def add_rows(self, count: int) -> None:
        self.rows += [self.make_index() for _ in range(count)]

    def compact(self) -> None:
        pass

    def begin_round(self) -> None:
        pass

    def nbytes(self) -> int:
        return sum(index.nbytes() for index in self.rows)

    def split(self, rows: list[int]) -> "SuffixDraftState":
        """Move `rows` out into a state of their own (what a router drafts apart)."""
        part = SuffixDraftState(self.make_index, [self.rows[r] for r in rows])
        moved = set(rows)
        self.rows = [index for r, index in enumerate(self.rows) if r not in moved]
        return part

    def merge(self, part: "SuffixDraftState", order: list[int]) -> None:
        """Take back the rows of `part` below ours, then put all rows in `order`."""
        rows = self.rows + part.rows
        self.rows = [rows[r] for r in order]


class SuffixDrafter(AngelSpecDrafterPreTrainedModel):
    """Drafts by suffix matching over the request's tokens and the target's earlier outputs; no weights, no target
    hidden states. The shared index is the `shared_tokens` buffer when saved (outputs separated by -1)."""

    config_class = SuffixDrafterConfig
    _no_split_modules = []
    reads_for_free = True

    def __init__(self, config: SuffixDrafterConfig):
        super().__init__(config)
        self.register_buffer(
            "shared_tokens", torch.full((config.shared_index_num_tokens,), SEPARATOR, dtype=torch.long)
        )
        self._shared: SuffixIndex | None = None  # built from `shared_tokens` on first use
        self._shared_outputs: deque[list[int]] = deque()
        self.post_init()

    # -- what the drafter contract asks of a drafter without weights ------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.shared_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # of the draft logits it returns

    def default_num_draft_tokens(self) -> int:
        return self.config.num_draft_tokens

    def target_hidden_state_indices(self) -> list[int]:
        return []

    def draft_layers(self) -> list:
        return []

    def draft_position_weights(self) -> torch.Tensor:
        return torch.ones(self.config.num_draft_tokens)

    def forward(self, *args, **kwargs) -> DraftPredictions:
        raise NotImplementedError("The suffix drafter has no weights to train: it drafts from suffix matches.")

    def check_target(self, target, tokenizer=None) -> None:
        """Only the vocabulary matters (and the tokenizer, when the drafter recorded one): the drafter reads token ids."""
        found = target.config.get_text_config().vocab_size
        problems = [] if found == self.config.vocab_size else [f"vocab_size: drafter expects {self.config.vocab_size}"]
        problems = [f"{p}, target has {found}" for p in problems]
        if tokenizer is not None and self.config.target_tokenizer_fingerprint is not None:
            from .targets import tokenizer_fingerprint

            if tokenizer_fingerprint(tokenizer) != self.config.target_tokenizer_fingerprint:
                problems.append("the tokenizer differs from the target tokenizer the drafter was made for")
        if problems:
            raise ValueError(
                f"Suffix drafter made for {self.config.target_name_or_path!r} does not match the target "
                f"{getattr(target.config, 'name_or_path', '?')!r}: " + "; ".join(problems)
            )

    def bind_target(self, target, tokenizer=None) -> "SuffixDrafter":
        self.check_target(target, tokenizer)
        if self.device != target.device:
            self.to(target.device)
        self._target_embed_tokens = target.get_input_embeddings()  # not read: marks the drafter as bound
        return self

    def new_index(self) -> SuffixIndex:
        config = self.config
        return SuffixIndex(config.min_match_length, config.max_match_length, config.max_candidates)

    def new_draft_state(self, batch_size: int = 1) -> SuffixDraftState:
        state = SuffixDraftState(self.new_index)
        state.add_rows(batch_size)
        return state

    # -- the shared index of earlier outputs --------------------------------------------------------------------

    @property
    def shared_index(self) -> SuffixIndex:
        if self._shared is None:
            self._shared = self.new_index()
            self._shared_outputs.clear()
            tokens = self.shared_tokens.tolist()
            start = 0
            for end in [i for i, token in enumerate(tokens) if token == SEPARATOR] + [len(tokens)]:
                if end > start:
                    self._shared_outputs.append(tokens[start:end])
                    self._shared.add_sequence(tokens[start:end])
                start = end + 1
        return self._shared

    def record_output(self, output_ids: list[int]) -> None:
        """Keep a finished output in the shared index; beyond `shared_index_max_tokens` the oldest outputs leave
        (the index is rebuilt without them, down to three quarters of the bound, so rebuilds stay rare)."""
        limit = self.config.shared_index_max_tokens
        output = [int(token) for token in output_ids][-limit:] if limit else []
        if len(output) < self.config.min_match_length + 1:
            return
        index = self.shared_index
        self._shared_outputs.append(output)
        if len(index) + len(output) + 1 <= limit:
            index.add_sequence(output)
            return
        kept, total = [], 0
        for sequence in reversed(self._shared_outputs):
            if total + len(sequence) + 1 > 3 * limit // 4 and kept:
                break
            kept.append(sequence)
            total += len(sequence) + 1
        self._shared_outputs = deque(reversed(kept))
        self._shared = self.new_index()
        for sequence in self._shared_outputs:
            self._shared.add_sequence(sequence)

    def prepare_for_saving(self) -> None:
        """The shared index into the `shared_tokens` buffer (the index's text), its length into the config."""
        tokens = self.shared_index.tokens
        self.shared_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        self.config.shared_index_num_tokens = len(tokens)

    def outlook(self, state: SuffixDraftState, row: int, pending_tokens: list[int]) -> int:
        """The length of the longest earlier match of row `row`'s context (its tokens, then `pending_tokens`)."""
        index = state.rows[row]
        suffix = (index.tokens[-self.config.max_match_length :] + list(pending_tokens))[
            -self.config.max_match_length :
        ]
        length = index.match(suffix)[0]
        if self.config.shared_index_max_tokens:
            length = max(length, self.shared_index.match(suffix)[0])
        return length if length >= self.config.min_match_length else 0

    # -- drafting ---------------------------------------------------------------------------------------------------

    def propose(
        self,
        state: SuffixDraftState,
        target_hidden: tuple[torch.Tensor, ...],
        new_token_ids: torch.LongTensor,
        num_tokens: int,
        choose: Callable[[torch.Tensor], torch.LongTensor],
        keep_drafting: Callable[[], bool] | None = None,
        new_lengths: torch.LongTensor | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Index each row's newly verified tokens, then draft up to `num_tokens` per row, step by step: the draft
        logits are log q of the module docstring (uniform for a row without a match of `min_match_length`), and
        `choose` picks the token. Drafting ends when no row has a match or `keep_drafting` says no."""
        batch, count = new_token_ids.shape
        lengths = new_lengths.tolist() if new_lengths is not None else [count] * batch
        for index, tokens, length in zip(state.rows, new_token_ids.tolist(), lengths):
            index.extend(tokens[:length])
        shared = self.shared_index if self.config.shared_index_max_tokens else None
        vocab = self.config.vocab_size
        suffixes = [index.tokens[-self.config.max_match_length :] for index in state.rows]
        matched = [True] * batch
        draft_ids, draft_logits = [], []
        for step in range(num_tokens):
            if step and keep_drafting is not None and not keep_drafting():
                break
            logits = torch.zeros(batch, vocab)
            for r, (index, suffix) in enumerate(zip(state.rows, suffixes)):
                if not matched[r]:
                    continue
                length, counts = index.match(suffix)
                if shared is not None:
                    shared_length, shared_counts = shared.match(suffix)
                    if shared_length > length:
                        length, counts = shared_length, shared_counts
                    elif shared_length == length:
                        counts = dict(counts)
                        for token, c in shared_counts.items():
                            counts[token] = counts.get(token, 0) + c
                if length < self.config.min_match_length:
                    matched[r] = False  # uniform from here on: confidence 1/V, never worth verifying
                    continue
                logits[r] = draft_log_probabilities(length, counts, vocab)
            if not any(matched):
                break
            tokens = choose(logits)
            draft_ids.append(tokens)
            draft_logits.append(logits)
            for suffix, token in zip(suffixes, tokens.tolist()):
                suffix.append(token)
                del suffix[: len(suffix) - self.config.max_match_length]
        device = new_token_ids.device
        if not draft_ids:
            return new_token_ids[:, :0], torch.zeros(batch, 0, vocab, device=device)
        return torch.stack(draft_ids, 1).to(device), torch.stack(draft_logits, 1).to(device)

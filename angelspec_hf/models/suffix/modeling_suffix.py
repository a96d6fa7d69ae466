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

import copy
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ...generation.dcut import FREE_ROUND_GAIN
from ..base import AngelSpecDrafterPreTrainedModel, DraftPredictions, check_int
from .configuration_suffix import SuffixDrafterConfig


SEPARATOR = -1  # between two sequences of an index: no match crosses it
PAST_END = -2  # what a suffix array match reads beyond its text
FOLD_TOKENS = 4096  # outputs recorded since the shared suffix array was built are folded in past a quarter of this


@dataclass(frozen=True)
class Match:
    """The longest earlier match of a context's suffix: its `length`, and for each text holding occurrences that
    long, the positions of the tokens that followed them (`parts`: (text, positions) pairs; a numpy text with an
    array of positions, or a list with a list). Drafting a token extends the suffix by it, and `follow` narrows the
    occurrences to those that token continues, so a draft step costs no new search."""

    length: int = 0
    parts: tuple = ()
    max_length: int = 0  # the index's max_match_length: a match that long stays that long

    @property
    def counts(self) -> dict[int, int]:
        """What followed the occurrences: next-token counts."""
        counts: dict[int, int] = {}
        for text, positions in self.parts:
            if isinstance(text, np.ndarray):
                tokens, found = np.unique(text[positions], return_counts=True)
                pairs = zip(tokens.tolist(), found.tolist())
            else:
                pairs = ((text[p], 1) for p in positions)
            for token, count in pairs:
                counts[token] = counts.get(token, 0) + count
        return counts

    def follow(self, token: int) -> "Match | None":
        """The match of the suffix extended by `token`: one longer (up to `max_length`), over the occurrences that
        `token` continued and that go on; None when none does (search afresh, for a shorter match). The same as a
        new search, except past `max_length`, where it keeps only occurrences that matched before."""
        parts = []
        for text, positions in self.parts:
            if isinstance(text, np.ndarray):
                kept = positions[text[positions] == token] + 1
                kept = kept[kept < len(text)]
                kept = kept[text[kept] != SEPARATOR]
            else:
                kept = [
                    p + 1 for p in positions if text[p] == token and p + 1 < len(text) and text[p + 1] != SEPARATOR
                ]
            if len(kept):
                parts.append((text, kept))
        return Match(min(self.length + 1, self.max_length), tuple(parts), self.max_length) if parts else None


class SuffixIndex:
    """A token text with, for each `key_length`-gram, the positions where it ended: finds the longest earlier match
    of a context's suffix and what followed it."""

    def __init__(self, key_length: int, max_match_length: int, max_candidates: int):
        self.key_length, self.max_match_length, self.max_candidates = key_length, max_match_length, max_candidates
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.read_ahead = 0  # leading tokens of the next round's verified tokens indexed already (`promised_gain`)
        self.end_matches: tuple[int, list] | None = None  # (text length, matches of the text's end) for this round

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

    def match(self, suffix: Sequence[int]) -> Match:
        """The longest match ℓ (at most `max_match_length`) of the end of `suffix` that has a next token in the text,
        over the occurrences that match that long; no match below `key_length`."""
        k = self.key_length
        if len(suffix) < k:
            return Match()
        best, positions = 0, []
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
            if length > best:
                best, positions = length, [end + 1]
            elif length == best:
                positions.append(end + 1)
        return Match(best, ((self.tokens, positions),), self.max_match_length) if best else Match()

    def nbytes(self) -> int:
        """Rough memory held (a Python list slot and an index entry per token)."""
        return 80 * len(self.tokens)


def suffix_array(text: np.ndarray) -> np.ndarray:
    """The start positions of `text`'s suffixes in lexicographic order (a suffix that ends sorts before any that
    goes on), by prefix doubling: O(n log² n) in numpy, about half a second for 300k tokens."""
    n = len(text)
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64).reshape(-1)
    order = np.argsort(rank, kind="stable")
    width = 1
    while width < n and rank[order[-1]] < n - 1:  # until every suffix has a rank of its own
        second = np.full(n, -1, dtype=np.int64)
        second[: n - width] = rank[width:]
        order = np.lexsort((second, rank))
        first, then = rank[order], second[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate([[0], np.cumsum((first[1:] != first[:-1]) | (then[1:] != then[:-1]))])
        width *= 2
    return order


class SuffixArrayIndex:
    """A fixed token text searched through the suffix array of its reverse (a datastore, as REST's, arXiv
    2311.08252): the longest match of a context's suffix, and the next-token counts over every occurrence of it, in
    O(ℓ log n). For the large shared text, where `SuffixIndex`, comparing only the most recent occurrences of its
    key, would miss the longer matches; built once, so it is not for text that grows every step."""

    def __init__(self, tokens: Sequence[int], key_length: int, max_match_length: int):
        self.key_length, self.max_match_length = key_length, max_match_length
        self.tokens = list(tokens)
        self.text = np.asarray(self.tokens, dtype=np.int64)
        reverse = self.text[::-1]
        # past the text's start (its reverse's end) a match reads PAST_END, below every token and SEPARATOR
        self.reverse = np.concatenate([reverse, np.full(max_match_length + 1, PAST_END, dtype=np.int64)])
        self.order = suffix_array(reverse)
        self.first = reverse[self.order]  # the first token of each sorted suffix: the ranges of one-token matches

    def __len__(self) -> int:
        return len(self.tokens)

    def match(self, suffix: Sequence[int]) -> Match:
        """As `SuffixIndex.match`, over every occurrence of the longest match (an occurrence at a sequence's end,
        followed by nothing, does not count)."""
        if len(suffix) < self.key_length or not self.tokens:
            return Match()
        lo = int(np.searchsorted(self.first, suffix[-1], "left"))
        ranges = [(lo, int(np.searchsorted(self.first, suffix[-1], "right")))]  # matches of length 1, 2, ...
        longest = min(len(suffix), self.max_match_length)
        while len(ranges) < longest and ranges[-1][0] < ranges[-1][1]:
            lo, hi = ranges[-1]
            token = self.reverse[self.order[lo:hi] + len(ranges)]  # sorted: these suffixes share the match so far
            ranges.append(
                (
                    lo + int(np.searchsorted(token, suffix[-1 - len(ranges)], "left")),
                    lo + int(np.searchsorted(token, suffix[-1 - len(ranges)], "right")),
                )
            )
        for length in range(len(ranges), self.key_length - 1, -1):
            lo, hi = ranges[length - 1]
            starts = self.order[lo:hi]
            following = len(self.tokens) - starts[starts > 0]  # the next token's position in the forward text
            following = following[self.text[following] != SEPARATOR]
            if len(following):
                return Match(length, ((self.text, following),), self.max_match_length)
        return Match()


class SharedIndex:
    """The target's earlier outputs, each a sequence (no match crosses two), at most `max_tokens` of them: a suffix
    array over those held when it was last built, and an n-gram index over the ones recorded since, folded into the
    array once they outgrow a quarter of it (rebuilding per output would cost the array's build each time)."""

    def __init__(self, key_length: int, max_match_length: int, max_candidates: int, max_tokens: int):
        self.key_length, self.max_match_length, self.max_candidates = key_length, max_match_length, max_candidates
        self.max_tokens = max_tokens
        self.sequences: deque[list[int]] = deque()
        self._build(0)

    def _build(self, folded: int) -> None:
        """The array over the first `folded` sequences, the n-gram index over the rest."""
        sequences = list(self.sequences)
        self.array = SuffixArrayIndex(join(sequences[:folded]), self.key_length, self.max_match_length)
        self.recent = SuffixIndex(self.key_length, self.max_match_length, self.max_candidates)
        for sequence in sequences[folded:]:
            self.recent.add_sequence(sequence)

    @property
    def tokens(self) -> list[int]:
        """The index's text: the sequences, oldest first, separated by SEPARATOR."""
        return join(self.sequences)

    def __len__(self) -> int:
        return len(self.array) + len(self.recent) + bool(self.array.tokens and self.recent.tokens)

    def add_sequences(self, sequences: Sequence[Sequence[int]]) -> None:
        """Keep `sequences` (the newest last); beyond `max_tokens` the oldest leave, down to three quarters of the
        bound (so that rebuilds stay rare), and the array is rebuilt over what stays."""
        sequences = [[int(token) for token in sequence][-self.max_tokens :] for sequence in sequences]
        sequences = [sequence for sequence in sequences if len(sequence) > self.key_length]
        if not sequences or not self.max_tokens:
            return
        self.sequences.extend(sequences)
        if len(self) + sum(len(sequence) + 1 for sequence in sequences) <= self.max_tokens:
            for sequence in sequences:
                self.recent.add_sequence(sequence)
            if len(self.recent) > max(len(self.array), FOLD_TOKENS) // 4:
                self._build(len(self.sequences))
            return
        kept, total = [], 0
        for sequence in reversed(self.sequences):
            if total + len(sequence) + 1 > 3 * self.max_tokens // 4 and kept:
                break
            kept.append(sequence)
            total += len(sequence) + 1
        self.sequences = deque(reversed(kept))
        self._build(len(self.sequences))

    def match(self, suffix: Sequence[int]) -> Match:
        return longest_match((self.array.match(suffix), self.recent.match(suffix)))

    def copy(self) -> "SharedIndex":
        """An index of the same outputs that grows apart from this one; the suffix array, never modified, is
        shared."""
        other = copy.copy(self)
        other.sequences = deque(self.sequences)
        other.recent = copy.deepcopy(self.recent)
        return other


def join(sequences: Sequence[Sequence[int]]) -> list[int]:
    """Sequences as one text, SEPARATOR between two."""
    text: list[int] = []
    for sequence in sequences:
        text += ([SEPARATOR] if text else []) + list(sequence)
    return text


def longest_match(matches: Sequence[Match]) -> Match:
    """The longest of several indexes' matches; the occurrences of equally long ones add up."""
    best = max((match.length for match in matches), default=0)
    if not best:
        return Match()
    parts = tuple(part for match in matches if match.length == best for part in match.parts)
    return Match(best, parts, max(match.max_length for match in matches))


def draft_log_probabilities(
    length: int, counts: dict[int, int], vocab_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """log q over the vocabulary for a match of `length` with next-token `counts` (the module docstring's q), into
    `out` (a row of the step's draft logits) when given: a fill and one write per counted token, not a log over the
    vocabulary."""
    weight = length / (length + 1)
    floor = (1 - weight) / vocab_size
    total = sum(counts.values())
    out = torch.empty(vocab_size) if out is None else out
    out.fill_(math.log(floor))
    out[torch.tensor(list(counts))] = torch.tensor(
        [math.log(floor + weight * count / total) for count in counts.values()], dtype=out.dtype
    )
    return out


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
    has_training_forward = False

    def __init__(self, config: SuffixDrafterConfig):
        super().__init__(config)
        self.register_buffer(
            "shared_tokens", torch.full((config.shared_index_num_tokens,), SEPARATOR, dtype=torch.long)
        )
        self._shared: SharedIndex | None = None  # built from `shared_tokens` on first use
        self._as_saved: tuple[torch.Tensor, int | None, SharedIndex] | None = None  # `_saved_index`
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
            from ...targets import tokenizer_fingerprint

            if tokenizer_fingerprint(tokenizer) != self.config.target_tokenizer_fingerprint:
                problems.append("the tokenizer differs from the target tokenizer the drafter was made for")
        if problems:
            raise ValueError(
                f"Suffix drafter made for {self.config.target_name_or_path!r} does not match the target "
                f"{getattr(target.config, 'name_or_path', '?')!r}: " + "; ".join(problems)
            )

    def bind_target(self, target, tokenizer=None) -> "SuffixDrafter":
        self.check_target_once(target, tokenizer)
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

    def new_shared_index(self) -> SharedIndex:
        config = self.config
        return SharedIndex(
            config.min_match_length, config.max_match_length, config.max_candidates, config.shared_index_max_tokens
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """A saved suffix drafter, its shared index checked: every id within the target's vocabulary."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        drafter = loaded[0] if isinstance(loaded, tuple) else loaded
        tokens = [token for token in drafter.shared_tokens.tolist() if token != SEPARATOR]
        drafter.check_token_ids([tokens], f"{pretrained_model_name_or_path}: the shared index (shared_tokens)")
        return loaded

    @property
    def shared_index(self) -> SharedIndex:
        """The target's earlier outputs: those saved (`shared_tokens`), then those recorded since."""
        if self._shared is None:
            self._shared = self._saved_index().copy()
        return self._shared

    def _saved_index(self) -> SharedIndex:
        """The index of `shared_tokens` as they are, built once per version of the buffer (a suffix array over
        300k tokens takes about half a second): forgetting the requests served keeps it."""
        tokens = self.shared_tokens
        version = tokens._version if not tokens.is_inference() else None  # inference tensors keep no version
        if self._as_saved is None or self._as_saved[0] is not tokens or self._as_saved[1] != version:
            index = self.new_shared_index()
            ids = tokens.tolist()
            bounds = [-1] + [i for i, token in enumerate(ids) if token == SEPARATOR] + [len(ids)]
            index.add_sequences([ids[start + 1 : end] for start, end in zip(bounds, bounds[1:])])
            self._as_saved = (tokens, version, index)
        return self._as_saved[2]

    def record_output(self, output_ids: list[int]) -> None:
        """Keep a finished output in the shared index (bounded by `shared_index_max_tokens`, the oldest leaving
        first)."""
        self.shared_index.add_sequences([output_ids])

    def check_token_ids(self, outputs: Sequence[Sequence[int]], where: str) -> None:
        """Raise ValueError, naming `where` and the id, if an output holds an id outside the target's vocabulary:
        a drafted id the target cannot read would break decoding, for every request that matched its text."""
        vocab_size = self.config.vocab_size
        for number, output in enumerate(outputs, 1):
            bad = next((token for token in output if not 0 <= token < vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"{where}, output {number}: token id {bad} is outside the target's vocabulary (0-{vocab_size - 1})"
                )

    def forget_served_requests(self) -> None:
        self._shared = None  # rebuilt from `shared_tokens`, the index as loaded or last saved

    def index_outputs(
        self, outputs: Sequence[Sequence[int]], max_tokens: int | None = None, source: str = "outputs to index"
    ) -> None:
        """Seed the shared index with a corpus of the target's outputs (its responses to a prompt set: a datastore),
        all at once so that the suffix array is built once; `max_tokens` first sets a new bound, under which what
        the index holds is kept (`angelspec index-outputs`). Ids outside the vocabulary are refused (`source`
        names the outputs in the error)."""
        outputs = [list(output) for output in outputs]
        self.check_token_ids(outputs, source)
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, minimum=0)
            outputs = list(self.shared_index.sequences) + outputs
            self.config.shared_index_max_tokens = max_tokens
            self._shared = self.new_shared_index()
        self.shared_index.add_sequences(outputs)

    def prepare_for_saving(self) -> None:
        """The shared index into the `shared_tokens` buffer (the index's text), its length into the config."""
        tokens = self.shared_index.tokens
        self.shared_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        self.config.shared_index_num_tokens = len(tokens)

    def shared_match(self, suffix: Sequence[int]) -> Match:
        """The longest match of `suffix` in the shared index (none when it is off)."""
        return self.shared_index.match(suffix) if self.config.shared_index_max_tokens else Match()

    def drafting_match(self, own: Match, shared: Match) -> Match:
        """The match a row drafts from: its own, unless the shared index's is longer by more than
        `shared_match_margin` tokens (the request's own text predicts it better at the same length: on Spec-Bench
        translation, taking the longer match of the two lost a third of τ)."""
        return shared if shared.length > own.length + self.config.shared_match_margin else own

    def _bounded_matches(
        self, state: SuffixDraftState, row: int, suffix: Sequence[int], own: Match | int, shared: Match | int
    ) -> tuple[list[Match | int], Match]:
        """Row `row`'s own and shared matches of `suffix`, each known (a `Match`) or bounded (an int: no new search
        finds a longer one; exact for the suffix array, nearly so for the n-gram index, which compares only recent
        occurrences), searched only where the bound could change `drafting_match`'s choice; and that choice."""
        margin = self.config.shared_match_margin
        if isinstance(own, int) and not (isinstance(shared, Match) and shared.length > own + margin):
            own = state.rows[row].match(suffix)
        if isinstance(shared, int) and not (isinstance(own, Match) and shared <= own.length + margin):
            shared = self.shared_match(suffix)
        if isinstance(own, int):
            return [own, shared], shared
        return [own, shared], own if isinstance(shared, int) else self.drafting_match(own, shared)

    def _after(self, match: Match | int, token: int) -> Match | int:
        """A row's match, or bound, once `token` extends its suffix: the match followed, else its length as the bound
        (no occurrence went on with `token`); an empty match bounds nothing (the token may start one), nor does a
        bound grow past `max_match_length`."""
        if isinstance(match, int):
            return min(match + 1, self.config.max_match_length)
        return match.follow(token) or match.length or self.config.max_match_length

    def promised_gain(self, state: SuffixDraftState, pending: list[list[int]] | None = None) -> float:
        """FREE_ROUND_GAIN when some row has a match (`outlook`, once each row has indexed its `pending` verified
        tokens, which the next round then skips), else 0 (nothing to draft). A round costs only index lookups, and
        D-cut's cut verifies none of its drafts whose calibrated confidence would not pay, so with a match the round
        drafts and the cut decides: the policy's average saving ĝ, which the many rounds whose drafts the cut drops
        pull below zero, would otherwise stop drafting on the rounds with a long match too."""
        for index, tokens in zip(state.rows, pending or [[] for _ in state.rows]):
            index.extend(tokens[index.read_ahead :])  # read now, so that skipped rounds keep the index current
            index.read_ahead = len(tokens)
        matched = any(self.outlook(state, r, []) for r in range(len(state.rows)))
        return FREE_ROUND_GAIN if matched else 0.0

    def read(self, state: SuffixDraftState, rows: list[int], tokens: list[list[int]]) -> None:
        for r, new in zip(rows, tokens):
            state.rows[r].extend(new)

    def outlook(self, state: SuffixDraftState, row: int, pending_tokens: list[int]) -> int:
        """The length of the longest earlier match of row `row`'s context (its tokens, then `pending_tokens`)."""
        index = state.rows[row]
        suffix = (index.tokens[-self.config.max_match_length :] + list(pending_tokens))[
            -self.config.max_match_length :
        ]
        unknown = self.config.max_match_length
        found = self.end_matches(state, row) if not pending_tokens else [unknown, unknown]
        length = self._bounded_matches(state, row, suffix, *found)[1].length
        return length if length >= self.config.min_match_length else 0

    def end_matches(self, state: SuffixDraftState, row: int) -> list[Match | int]:
        """Row `row`'s own and shared matches (or bounds) of its text's end, as `_bounded_matches` finds them: searched
        once per round, which both `outlook` and the round's `propose` read."""
        index = state.rows[row]
        if index.end_matches is None or index.end_matches[0] != len(index):
            unknown = self.config.max_match_length
            suffix = index.tokens[-unknown:]
            index.end_matches = (len(index), self._bounded_matches(state, row, suffix, unknown, unknown)[0])
        return list(index.end_matches[1])

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
            index.extend(tokens[index.read_ahead : length])
            index.read_ahead = 0
        vocab = self.config.vocab_size
        suffixes = [index.tokens[-self.config.max_match_length :] for index in state.rows]
        matched = [True] * batch
        # each row's (own, shared) match of its suffix so far, or where a drafted token ended it, a bound on the
        # length a new search could find (`_bounded_matches`)
        found = [self.end_matches(state, r) for r in range(batch)]
        draft_ids, draft_logits = [], []
        for step in range(num_tokens):
            if step and keep_drafting is not None and not keep_drafting():
                break
            logits = torch.zeros(batch, vocab)
            for r, suffix in enumerate(suffixes):
                if not matched[r]:
                    continue
                found[r], match = self._bounded_matches(state, r, suffix, *found[r])
                if match.length < self.config.min_match_length:
                    matched[r] = False  # uniform from here on: confidence 1/V, never worth verifying
                    continue
                draft_log_probabilities(match.length, match.counts, vocab, out=logits[r])
            if not any(matched):
                break
            tokens = choose(logits)
            draft_ids.append(tokens)
            draft_logits.append(logits)
            for r, (suffix, token) in enumerate(zip(suffixes, tokens.tolist())):
                suffix.append(token)
                del suffix[: len(suffix) - self.config.max_match_length]
                if matched[r]:  # the token extends each match, or ends it: a new search then finds one at most as long
                    found[r] = [self._after(match, token) for match in found[r]]
        device = new_token_ids.device
        if not draft_ids:
            return new_token_ids[:, :0], torch.zeros(batch, 0, vocab, device=device)
        return torch.stack(draft_ids, 1).to(device), torch.stack(draft_logits, 1).to(device)

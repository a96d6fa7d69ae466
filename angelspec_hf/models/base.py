"""What every AngelSpec drafter shares: its binding to a target, the reduced draft vocabulary, family layers.

A drafter reuses the target's token embedding and lm_head (frozen, never copied into its checkpoint) and builds
its own layers from the target's transformers family (Llama, Qwen2/3, Mistral, ...), so a drafter for a new family
needs no new layer code. Concrete drafters (MTP, DFly) subclass `AngelSpecDrafterConfig` and
`AngelSpecDrafterPreTrainedModel`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from ..cache_utils import RaggedCache


# Config keys of a target that describe its weights or provenance, not the shape of a layer.
_HUB_OPTIONS = ("repo_id", "token", "private", "commit_message", "revision", "create_pr")  # of push_to_hub
_NON_LAYER_KEYS = (
    "architectures",
    "auto_map",
    "quantization_config",
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "layer_types",
    "dtype",
    "torch_dtype",
    "output_hidden_states",
    "_attn_implementation_autoset",
)
# Target config keys a drafter is built from.
_REQUIRED_TARGET_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")


@dataclass
class DraftPredictions(ModelOutput):
    """What a drafter's training forward returns: every supervised draft prediction, flattened.

    `logits` [N, V_draft]; `teacher_positions` [N]: flat index into the batch's (row, position) grid of the target
    position whose next-token distribution is the teacher; `draft_positions` [N]: 1-based position of the prediction
    in its draft (MTP depth, DFly block offset), which sets its loss weight.
    """

    logits: torch.Tensor | None = None
    teacher_positions: torch.LongTensor | None = None
    draft_positions: torch.LongTensor | None = None
    hidden_states: torch.Tensor | None = (
        None  # [N, H] the draft features the head reads, where a drafter regresses them
    )


@dataclass
class DraftState:
    """A drafter's per-generation state: its KV cache (one ragged row per sequence) and how many columns are
    committed (verified context); the columns after them hold the last round's speculative drafts, dropped when
    the next round begins."""

    cache: RaggedCache
    num_committed: int = 0

    def begin_round(self) -> None:
        """Drop the last round's speculative columns."""
        self.cache.crop(self.cache.width - self.num_committed)

    def commit(self) -> None:
        """Everything in the cache so far is verified context."""
        self.num_committed = self.cache.width

    def select_rows(self, rows: torch.LongTensor) -> None:
        self.cache.select_rows(rows)

    def add_rows(self, count: int) -> None:
        """Empty rows for joining sequences (their context arrives with the next round's verified positions)."""
        self.cache.append_rows(RaggedCache(count, self.cache.valid.device))

    def compact(self) -> None:
        self.begin_round()
        self.cache.compact()
        self.commit()

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def split(self, rows: list[int]) -> "DraftState":
        """Move `rows` out into a state of their own (what a router drafts apart); both are left fully committed."""
        self.begin_round()
        part = DraftState(self.cache.split_rows(torch.tensor(rows, dtype=torch.long)))
        part.commit()
        return part

    def merge(self, part: "DraftState", order: list[int]) -> None:
        """Take back the rows of `part` (dropping its speculative columns) below ours, then put all rows in `order`
        (indices into ours followed by the part's)."""
        self.begin_round()
        part.begin_round()
        self.cache.append_rows(part.cache)
        self.cache.select_rows(torch.tensor(order, dtype=torch.long))
        self.commit()


@dataclass(frozen=True)
class FamilyClasses:
    """The transformers building blocks of one model family, e.g. `LlamaDecoderLayer`, `LlamaRMSNorm`."""

    decoder_layer: type[nn.Module]
    rms_norm: type[nn.Module]
    rotary_embedding: type[nn.Module]
    apply_rotary_pos_emb: Callable


def family_classes(model_type: str) -> FamilyClasses:
    """Look up the decoder layer, RMSNorm and rotary embedding classes of a transformers model family."""
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError as error:
        raise ValueError(f"No transformers modeling file for model type {model_type!r}") from error
    layer_names = [name for name in dir(module) if name.endswith("DecoderLayer")]
    if len(layer_names) != 1:
        raise ValueError(f"Cannot find a single decoder layer class for model type {model_type!r}: {layer_names}")
    prefix = layer_names[0][: -len("DecoderLayer")]
    try:
        return FamilyClasses(
            getattr(module, layer_names[0]),
            getattr(module, f"{prefix}RMSNorm"),
            getattr(module, f"{prefix}RotaryEmbedding"),
            module.apply_rotary_pos_emb,
        )
    except AttributeError as error:
        raise ValueError(
            f"Model type {model_type!r} has no RMSNorm / rotary embedding to build a drafter from"
        ) from error


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    """Raise `ValueError` naming the config field `name` unless `value` is an integer in [minimum, maximum]."""
    valid = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if not valid or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


def check_number(name: str, value, positive: bool = False) -> None:
    """Raise `ValueError` naming the config field `name` unless `value` is a non-negative (or positive) number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} number, got {value!r}")


def check_bool(name: str, value) -> None:
    """Raise `ValueError` naming the config field `name` unless `value` is `True` or `False`."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_target_config(target_config) -> None:
    """Raise `ValueError` naming `target_config` unless it is empty (a default config) or a target's text config."""
    if not isinstance(target_config, dict):
        raise ValueError(f"target_config must be the target's text config as a dict, got {target_config!r}")
    if not target_config:
        return
    missing = [key for key in _REQUIRED_TARGET_KEYS if target_config.get(key) is None]
    if missing:
        raise ValueError(f"target_config lacks {', '.join(missing)}: it must be the target's text config")
    if not isinstance(target_config["model_type"], str):
        raise ValueError(f"target_config['model_type'] must be a string, got {target_config['model_type']!r}")
    for key in _REQUIRED_TARGET_KEYS[1:]:
        check_int(f"target_config[{key!r}]", target_config[key])


def embedding_probe(embedding: torch.Tensor) -> list[float]:
    """Row sums of a few fixed rows of the target embedding: tells two same-shaped targets apart."""
    rows = torch.linspace(0, embedding.shape[0] - 1, 8).long()
    return [round(value, 4) for value in embedding.detach()[rows].float().sum(-1).tolist()]


class AngelSpecDrafterConfig(PretrainedConfig):
    r"""
    Fields every drafter has.

    Args:
        target_config (`dict`): the target's text config (its family and layer shapes); draft layers are built from it.
            Empty only in a default config (as transformers builds for defaults), from which no drafter is built.
        target_name_or_path (`str`): the target the drafter was trained for (Hub id or path), for the record.
        target_tokenizer_fingerprint (`str`): `angelspec_hf.targets.tokenizer_fingerprint` of the target tokenizer.
        target_embedding_probe (`list[float]`): `embedding_probe` of the target embedding, checked when binding.
        draft_vocab_size (`int`, *optional*): size of the reduced draft vocabulary (EAGLE-3's d2t); `None` drafts
            over the full target vocabulary with the target's own lm_head.
        loss_type (`str`): distillation loss per draft prediction: `"kl"` (KL(p_target || q_draft)), `"ce"` (cross
            entropy with the target's argmax), `"tv"` (total variation, 1 - α with α = Σ min(p, q)) or `"lk"`
            (λ·KL + (1-λ)·TV with λ = exp(-η·sg[α]), AngelSpec's hybrid).
        kl_top_k (`int`, *optional*): distil only the teacher's top-k tokens (renormalised) to bound memory.
        lk_eta (`float`): η of the `"lk"` loss.
        hidden_noise_std (`float`, defaults to 0): in training, Gaussian noise of this standard deviation (relative to
            each state's RMS) added to the target states the drafter reads (EAGLE's feature noise), not to the teacher.
    """

    drafter_kind: str  # the family's name in benchmark tables and method labels (`mtp`, `dfly`, ...)

    def __init__(
        self,
        target_config: dict | None = None,
        target_name_or_path: str | None = None,
        target_tokenizer_fingerprint: str | None = None,
        target_embedding_probe: list[float] | None = None,
        draft_vocab_size: int | None = None,
        loss_type: str = "kl",
        kl_top_k: int | None = None,
        lk_eta: float = 3.0,
        hidden_noise_std: float = 0.0,
        **kwargs,
    ):
        check_target_config(target_config or {})
        check_number("hidden_noise_std", hidden_noise_std)
        self.hidden_noise_std = hidden_noise_std
        self.target_config = {k: v for k, v in (target_config or {}).items() if k not in _NON_LAYER_KEYS}
        target_vocab_size = self.target_config.get("vocab_size")
        if draft_vocab_size is not None:
            check_int("draft_vocab_size", draft_vocab_size, maximum=target_vocab_size)
        if loss_type not in ("kl", "ce", "tv", "lk"):
            raise ValueError(f"loss_type must be one of kl, ce, tv, lk; got {loss_type!r}")
        if kl_top_k is not None:
            check_int("kl_top_k", kl_top_k, maximum=draft_vocab_size or target_vocab_size)
        check_number("lk_eta", lk_eta)
        self.loss_type = loss_type
        self.kl_top_k = kl_top_k
        self.lk_eta = lk_eta
        self.target_name_or_path = target_name_or_path
        self.target_tokenizer_fingerprint = target_tokenizer_fingerprint
        self.target_embedding_probe = target_embedding_probe
        self.draft_vocab_size = draft_vocab_size
        # Mirrored from the target: generate() compares vocab sizes, and layers read these.
        self.hidden_size = self.target_config.get("hidden_size")
        self.vocab_size = self.target_config.get("vocab_size")
        self.target_model_type = self.target_config.get("model_type")
        self.target_num_hidden_layers = self.target_config.get("num_hidden_layers")
        self.initializer_range = self.target_config.get("initializer_range", 0.02)
        # The target's special tokens: pipelines compare them with the target's to tell a shared tokenizer.
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if kwargs.get(key) is None:
                kwargs[key] = self.target_config.get(key)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def draft_layer_config(self, num_layers: int = 1) -> PretrainedConfig:
        """A config of the target's family shaped for `num_layers` draft layers (sdpa attention, no sliding window)."""
        values = dict(self.target_config)
        model_type = values.pop("model_type")
        values.update(num_hidden_layers=num_layers, use_sliding_window=False, sliding_window=None)
        layer_config = AutoConfig.for_model(model_type, **values)
        layer_config._attn_implementation = "sdpa"
        return layer_config


# The package modules every drafter's remote code carries beside its own files: with them, a drafter loaded by
# `AutoModel.from_pretrained(dir, trust_remote_code=True)` where this package is not installed drafts in
# `generate(assistant_model=...)` (speculative.install), one sequence or a batch, with D-cut.
REMOTE_CODE_HELPERS = (
    "targets.py",
    "cache_utils.py",
    "hub.py",
    "metrics.py",
    "generation/speculative.py",
    "generation/candidate_generator.py",
    "generation/engine.py",
    "generation/policies.py",
    "generation/schedules.py",
    "generation/session.py",
    "generation/routing.py",
    "generation/dcut.py",
    "generation/draft_round.py",
    "generation/measurements.py",
    "generation/verify_cost.py",
    "generation/kernels.py",
    "generation/timing.py",
    "generation/target_states.py",
)


try:
    import fcntl  # POSIX: saves of one folder take turns; elsewhere they are not serialized
except ImportError:  # pragma: no cover
    fcntl = None


@contextlib.contextmanager
def folder_lock(folder: str):
    """Hold an exclusive `flock` on `folder` itself (no lock file to leave behind): the saves into one parent folder,
    by threads or processes, take turns."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def remove_stale_staging(parent: str) -> None:
    """Remove the staging folders (`.<name>.saving-*`) in `parent`: with its lock held no save is running there,
    so they are what killed saves left."""
    for entry in os.listdir(parent):
        if re.fullmatch(r"\..+\.saving-[^/]+", entry) and os.path.isdir(os.path.join(parent, entry)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


class AngelSpecDrafterPreTrainedModel(PreTrainedModel):
    """Base class: binding to the target's frozen embedding and lm_head, and the (reduced) draft vocabulary head."""

    config_class = AngelSpecDrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(self, config: AngelSpecDrafterConfig):
        if not config.target_config:
            raise ValueError(
                f"{type(config).__name__} has no target_config: a drafter is built from its target's config "
                f"(`{type(self).__name__}.from_target(target, ...)` records it)"
            )
        super().__init__(config)
        if config.draft_vocab_size:
            # EAGLE-3-style reduced vocabulary: own small head over the most frequent target tokens.
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.lm_head = None
            self.draft_to_target = None
        self._target_embed_tokens = None
        self._target_lm_head = None
        self._target_tokenizer = None  # saved with the drafter, so that a pipeline can load it by path or id
        self._checked_target = None  # (config, embedding weight, tokenizer) that `check_target` last passed
        # generate() reads drafting settings from the assistant's generation config, as for any assistant model:
        # at most `num_assistant_tokens` drafted per round, the verified prefix chosen by D-cut by default.
        self.generation_config = GenerationConfig(
            num_assistant_tokens=self.default_num_draft_tokens(), num_assistant_tokens_schedule="dcut"
        )

    routes_members = False  # a router: a routing policy chooses which member drafts each request (generation/routing)
    reads_for_free = False  # reading verified tokens costs it nothing (no weights): a router lets it read every round
    # `forward` predicts drafts from target states (what the Trainer and the offline estimate call); the suffix drafter
    # and the router have none (they draft from matches, or through their members)
    has_training_forward = True

    @property
    def speculation_stats(self):
        """The last decoding call's `SpeculationStats` (None before one): a read-only view of what the decoding
        session measured (`generation/session.py`)."""
        from ..generation.session import memory_of  # here: the generation modules import this one

        return memory_of(self).stats

    def default_num_draft_tokens(self) -> int:
        """Draft tokens per round unless `generation_config.num_assistant_tokens` says otherwise."""
        raise NotImplementedError

    def max_num_draft_tokens(self) -> int | None:
        """Most tokens one round can draft (None: no limit)."""
        return None

    def target_hidden_state_indices(self) -> list[int]:
        """Indices into the target's `hidden_states` (0 = embeddings, i + 1 = output of layer i) that condition drafts."""
        raise NotImplementedError

    def training_hidden_state_indices(self) -> list[int]:
        """The conditioning states plus, last, the target's final (normed) state, whose lm_head is the teacher."""
        final = self.config.target_num_hidden_layers
        return [i for i in self.target_hidden_state_indices() if i != final] + [final]

    # -- the drafter contract: what the Trainer and the decoding loops call -------------------------------------------

    def forward(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        document_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
    ) -> DraftPredictions:
        """Training forward on packed rows, drafting as inference does.

        `target_hidden` [B, S, T, H]: the target states at `training_hidden_state_indices()` (S of them, the final
        normed state last, whose lm_head is the teacher); `input_ids`, `position_ids` (restarting per document),
        `document_ids` [B, T]; `loss_mask` [B, T]: 1 on response tokens, the only ones predicted. In eval mode the
        predictions are the greedy draft chains that the offline acceptance estimate walks.
        """
        raise NotImplementedError

    def propose(
        self,
        state: DraftState,
        target_hidden: tuple[torch.Tensor, ...],
        new_token_ids: torch.LongTensor,
        num_tokens: int,
        choose: Callable[[torch.Tensor], torch.LongTensor],
        keep_drafting: Callable[[], bool] | None = None,
        new_lengths: torch.LongTensor | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """One drafting round for B rows, after the target verified some tokens of each.

        `target_hidden`: one [B, N, H] tensor per index of `target_hidden_state_indices()`, the target states of
        the N newly verified positions; `new_token_ids` [B, N]: the token after each (the last real one is the bonus
        token); in a ragged batch only the first `new_lengths[r]` columns of row r are real. `choose` maps
        draft-vocabulary logits [B, V_draft] to draft-vocabulary ids [B] (argmax or a draw, see `DraftRound`);
        `keep_drafting`, when given, is asked before each further sequential step and ends the round when it says
        no. Returns target-vocabulary ids [B, K] and their draft logits [B, K, V_draft], K <= `num_tokens`.
        """
        raise NotImplementedError

    def outlook(self, state, row: int, pending_tokens: list[int]) -> int | None:
        """A cheap look, before drafting, at how well row `row` of `state` can be drafted now, given the tokens it
        verified since this drafter last read (`pending_tokens`): the suffix drafter's current match length. None
        for a drafter without one. A router's routing policy ranks members by their record at each outlook."""
        return None

    def read(self, state, rows: list[int], tokens: list[list[int]]) -> None:
        """Read verified tokens into rows `rows` of `state` without drafting (`tokens[i]` for row `rows[i]`): what a
        router asks of a member that `reads_for_free` on the rounds it drafts with another, and before it weighs
        them, so that the member's `outlook` stays current at the cost of its index updates alone."""
        raise NotImplementedError(f"{type(self).__name__} does not read for free (reads_for_free is False)")

    def promised_gain(self, state, pending: list[list[int]] | None = None) -> float | None:
        """The fraction of a round's time the next drafting round of `state` is expected to save, its catch-up on
        verified tokens included (`pending[r]`: the tokens row r verified since the drafter last read), for a drafter
        that knows better than the verify policy's average (the suffix drafter, when a row has a match);
        None leaves it to the policy."""
        return None

    def prepare_for_saving(self) -> None:
        """Bring state kept outside the tensors (the suffix drafter's shared index) into them before a save."""

    def record_output(self, output_ids: list[int]) -> None:
        """A finished request's generated tokens, told by `generate()` and the engine. Drafters that learn while
        serving keep them (the suffix drafter's shared index); the others ignore them."""

    def forget_served_requests(self) -> None:
        """Drop what serving taught the drafter since it was loaded or saved (the suffix index's recorded outputs):
        it drafts as loaded again. `generation.session.forget_served_requests(drafter)` also drops what decoding
        learned of its requests (a router's routing records); each measured benchmark run starts there."""

    def draft_position_weights(self) -> torch.Tensor:
        """Loss weight of draft position k = 1..K."""
        raise NotImplementedError

    def draft_layers(self) -> list[nn.Module]:
        """The drafter's decoder layers (of the target's family), in order."""
        raise NotImplementedError

    @torch.no_grad()
    def warm_start(self, target: PreTrainedModel) -> None:
        """Start from the target instead of random layers: the draft layers become copies of the target's last
        layers (same family and shapes), the final norm the target's."""
        draft_layers = self.draft_layers()
        for draft_layer, target_layer in zip(draft_layers, list(target.get_decoder().layers)[-len(draft_layers) :]):
            draft_layer.load_state_dict(target_layer.state_dict())
        self.norm.load_state_dict(target.get_decoder().norm.state_dict())

    @torch.no_grad()
    def zero_output_projections(self) -> None:
        """Zero each draft layer's residual output projections (attention `o_proj`, MLP `down_proj`): every layer
        starts as the identity."""
        for layer in self.draft_layers():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()

    def lora_target_modules(self) -> list[str]:
        """The drafter's own linear layers but its draft-vocabulary head, for `peft.LoraConfig(target_modules=...)`
        (the target's embedding and lm_head are borrowed, not modules of the drafter): domain adaptation with LoRA."""
        return [name for name, module in self.named_modules() if isinstance(module, nn.Linear) and name != "lm_head"]

    def new_draft_state(self, batch_size: int = 1) -> DraftState:
        return DraftState(cache=RaggedCache(batch_size, self.device))

    @classmethod
    def from_target(
        cls, target: PreTrainedModel, tokenizer=None, layer_settings: dict | None = None, **config_kwargs
    ) -> "AngelSpecDrafterPreTrainedModel":
        """A freshly initialised drafter for `target`, bound to it and recording what it was built for.
        `layer_settings`: target config values the draft layers are built with instead of the target's own (those
        of a native MTP block, say)."""
        from ..targets import tokenizer_fingerprint

        config = cls.config_class(
            target_config={**cls.target_config_dict(target), **(layer_settings or {})},
            target_name_or_path=getattr(target.config, "name_or_path", None),
            target_tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
            target_embedding_probe=embedding_probe(target.get_input_embeddings().weight),
            **config_kwargs,
        )
        drafter = cls(config).to(dtype=target.dtype, device=target.device)
        return drafter.bind_target(target, tokenizer)

    # -- target binding -------------------------------------------------------------------------------------------

    @staticmethod
    def target_config_dict(target: PreTrainedModel) -> dict:
        return target.config.get_text_config().to_dict()

    def check_target(self, target: PreTrainedModel, tokenizer=None) -> None:
        """Raise `ValueError` naming the mismatch if `target` (and `tokenizer`) are not what this drafter was trained for."""
        expected, found = self.config.target_config, self.target_config_dict(target)
        problems = [
            f"{key}: drafter expects {expected.get(key)!r}, target has {found.get(key)!r}"
            for key in ("model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")
            if expected.get(key) != found.get(key)
        ]
        probe = self.config.target_embedding_probe
        if not problems and probe is not None:
            found_probe = embedding_probe(target.get_input_embeddings().weight)
            if not torch.allclose(torch.tensor(probe), torch.tensor(found_probe), rtol=1e-2, atol=1e-2):
                problems.append("the target's token embedding differs from the one the drafter was trained with")
        if tokenizer is not None and self.config.target_tokenizer_fingerprint is not None:
            from ..targets import tokenizer_fingerprint

            if tokenizer_fingerprint(tokenizer) != self.config.target_tokenizer_fingerprint:
                problems.append("the tokenizer differs from the target tokenizer the drafter was trained with")
        if problems:
            raise ValueError(
                f"Drafter trained for {self.config.target_name_or_path!r} does not match the target "
                f"{getattr(target.config, 'name_or_path', '?')!r}: " + "; ".join(problems)
            )

    def check_target_once(self, target: PreTrainedModel, tokenizer=None) -> None:
        """`check_target`, skipped for the target (its config and embedding) and tokenizer that last passed it: every
        `generate()` call binds its assistant again."""
        checked = (target.config, target.get_input_embeddings().weight, tokenizer)
        if self._checked_target is None or any(a is not b for a, b in zip(checked, self._checked_target)):
            self.check_target(target, tokenizer)
            self._checked_target = checked

    def bind_target(self, target: PreTrainedModel, tokenizer=None) -> "AngelSpecDrafterPreTrainedModel":
        """Check `target` and share its embedding and lm_head (frozen, not registered: never saved with the drafter).

        The drafter moves to the target's dtype and device: a checkpoint stored in half precision drafts in the
        target's precision.
        """
        self.check_target_once(target, tokenizer)
        if self.dtype != target.dtype or self.device != target.device:
            self.to(dtype=target.dtype, device=target.device)
        self._borrow_target(target, tokenizer)
        return self

    def _borrow_target(self, target: PreTrainedModel, tokenizer=None) -> None:
        """Share the target's embedding and lm_head, keep its tokenizer (when given) to save beside the drafter, and
        run the target's linear-kernel plan, if any (`generation.kernels`)."""
        from ..generation.kernels import follow_plan, untune_linear_kernels
        from ..generation.measurements import installed_plan

        plan = installed_plan(target)
        if plan is not None:
            follow_plan(self, plan)
        else:
            untune_linear_kernels(self)
        self._target_embed_tokens = target.get_input_embeddings()
        self._target_lm_head = target.get_output_embeddings()
        if tokenizer is not None:
            self._target_tokenizer = tokenizer

    @property
    def is_bound(self) -> bool:
        return self._target_embed_tokens is not None

    def __setattr__(self, name, value):
        # Target modules are borrowed, not owned: keep them out of `_modules` (state dict, DDP, `.to`).
        if name in ("_target_embed_tokens", "_target_lm_head", "_target_tokenizer", "_checked_target"):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def _require_target(self):
        if self._target_embed_tokens is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a target: call `drafter.bind_target(target)` first "
                "(generate(assistant_model=drafter) does this for you)."
            )

    def embed_tokens(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """E(x): the target's frozen token embedding."""
        self._require_target()
        return self._target_embed_tokens(input_ids)

    # -- draft vocabulary -----------------------------------------------------------------------------------------

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the full target vocabulary when no reduced vocabulary is configured)."""
        if self.lm_head is not None:
            return self.lm_head(hidden_states)
        self._require_target()
        return self._target_lm_head(hidden_states)

    def target_head_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's lm_head restricted to the draft vocabulary: the teacher in distillation."""
        self._require_target()
        weight = self._target_lm_head.weight
        if self.draft_to_target is not None:
            weight = weight[self.draft_to_target]
        return hidden_states @ weight.T

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits into the full vocabulary (tokens outside it get -inf, probability 0)."""
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_to_target, logits)

    def with_full_vocabulary(self) -> "AngelSpecDrafterPreTrainedModel":
        """The same drafter drafting over the full target vocabulary with the target's own lm_head (shared weights
        otherwise): what the reduced vocabulary saves is measured against this."""
        config = self.config.__class__.from_dict({**self.config.to_dict(), "draft_vocab_size": None})
        full = self.__class__(config).to(dtype=self.dtype, device=self.device)
        state = {k: v for k, v in self.state_dict().items() if not k.startswith(("lm_head.", "draft_to_target"))}
        full.load_state_dict(state)
        full.generation_config = self.generation_config
        full._target_embed_tokens, full._target_lm_head = self._target_embed_tokens, self._target_lm_head
        return full.eval()

    @torch.no_grad()
    def init_draft_vocab(self, token_counts: torch.Tensor, always_keep: list[int] = ()) -> None:
        """Choose the `draft_vocab_size` most frequent target tokens (plus `always_keep`, e.g. EOS) and initialise
        the draft head from the target's lm_head rows of those tokens."""
        self._require_target()
        counts = token_counts.double().clone()
        counts[list(always_keep)] = float("inf")
        chosen = torch.topk(counts, self.config.draft_vocab_size).indices.sort().values
        self.draft_to_target.copy_(chosen)
        self.lm_head.weight.copy_(self._target_lm_head.weight[chosen])

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, *args, remote_code: bool = False, **kwargs) -> None:
        """Save weights, config and generation config (the drafting settings `generate()` reads: verify policy and
        tokens per round) — never the target's embedding or lm_head — atomically.

        Files are written to a staging folder beside `save_directory` and moved in only once all exist, config
        last, so an interrupted save never leaves a half-written checkpoint. Saves into one parent folder take turns
        (`folder_lock`), and each clears the staging folders that killed saves left there.
        With `remote_code=True` (what `push_to_hub` publishes) the folder also gets the package's code and an
        `auto_map`, so it loads with `trust_remote_code=True` where this package is not installed; without, it
        holds no code and loads where the package is imported, as a Hub model of a built-in architecture does.
        """
        push_to_hub = kwargs.pop("push_to_hub", False)
        hub_options = {key: kwargs.pop(key) for key in _HUB_OPTIONS if key in kwargs}
        save_directory = os.path.abspath(save_directory)
        parent = os.path.dirname(save_directory)
        os.makedirs(parent, exist_ok=True)
        with folder_lock(parent):
            remove_stale_staging(parent)
            if os.path.isdir(save_directory):  # folders a killed save of this one was swapping out
                for entry in os.listdir(save_directory):
                    if re.fullmatch(r"\.(.+)\.old-[^/]+", entry):
                        shutil.rmtree(os.path.join(save_directory, entry), ignore_errors=True)
            self._save_staged(save_directory, parent, *args, remote_code=remote_code, **kwargs)
        if push_to_hub:  # the drafter as saved, with its code, and the folder's card, to the repository named after it
            self.push_to_hub(
                hub_options.pop("repo_id", os.path.basename(save_directory)), folder=save_directory, **hub_options
            )

    def _save_staged(self, save_directory: str, parent: str, *args, **kwargs) -> None:
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(save_directory)}.saving-", dir=parent)
        try:
            self.write_checkpoint(staging, *args, **kwargs)
            os.makedirs(save_directory, exist_ok=True)
            for name in sorted(os.listdir(staging), key=lambda name: name == "config.json"):
                destination = os.path.join(save_directory, name)
                if os.path.isdir(destination):  # a folder (a router's members) is swapped in whole
                    retired = tempfile.mkdtemp(prefix=f".{name}.old-", dir=save_directory)
                    os.replace(destination, os.path.join(retired, name))
                    os.replace(os.path.join(staging, name), destination)
                    shutil.rmtree(retired, ignore_errors=True)
                else:
                    os.replace(os.path.join(staging, name), destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def push_to_hub(self, repo_id: str, folder: str | None = None, card=None, **options):
        """Upload this drafter to the Hub repository `repo_id` in one commit: weights, config, generation config,
        remote code (`auto_map`), the bound target's tokenizer and a model card (`angelspec_hf.hub.drafter_card`
        unless the folder has one or `card` is given). `options`: `token`, `private`, `commit_message`,
        `revision`, `create_pr`."""
        from ..hub import upload_drafter

        unknown = sorted(set(options) - set(_HUB_OPTIONS))
        if unknown:
            raise TypeError(f"push_to_hub got unexpected options {unknown}; it takes {sorted(_HUB_OPTIONS)}")
        return upload_drafter(self, repo_id, folder=folder, card=card, **options)

    def write_checkpoint(self, directory: str, *args, remote_code: bool = False, **kwargs) -> None:
        """Everything a checkpoint holds (weights, config, generation config, the target's tokenizer when bound; the
        package's code with `remote_code`), written into `directory`; `save_pretrained` makes it atomic."""
        self.prepare_for_saving()
        PreTrainedModel.save_pretrained(self, directory, *args, **kwargs)
        self.generation_config.save_pretrained(directory)  # transformers saves it only for models that generate
        self.save_target_tokenizer(directory)
        self._set_auto_map(directory, self.write_remote_code(directory) if remote_code else None)

    def save_target_tokenizer(self, directory: str) -> None:
        """The tokenizer the drafter was bound with, if any: `pipeline(..., assistant_model=<path or id>)` loads the
        assistant's tokenizer from the same folder (and, the vocabulary being the target's, then shares the target's)."""
        if self._target_tokenizer is not None:
            self._target_tokenizer.save_pretrained(directory)

    def remote_code_modules(self) -> list:
        """The package modules this drafter's remote code needs besides `base` and its helpers."""
        return [importlib.import_module(type(self).__module__), importlib.import_module(type(self.config).__module__)]

    def write_remote_code(self, directory: str) -> dict:
        """Copy this drafter's configuration/modeling files and their package helpers, flattened into one folder, and
        the draft-verify entry point as `custom_generate/generate.py` (`generation/hub_generate.py`); returns the
        `auto_map` that names its classes there. Written when a drafter is published, from the package as it is
        then, never kept beside the package's own source."""
        package = os.path.dirname(os.path.abspath(__file__))
        model_module = importlib.import_module(type(self).__module__)
        config_module = importlib.import_module(type(self.config).__module__)
        sources = [module.__file__ for module in self.remote_code_modules()] + [__file__]
        sources += [os.path.join(os.path.dirname(package), helper) for helper in REMOTE_CODE_HELPERS]
        for source in dict.fromkeys(sources):
            with open(source) as handle:  # `from ..mtp.modeling_mtp import` and `from ..base import` alike
                code = re.sub(r"from \.+(?:\w+\.)*(\w+) import", r"from .\1 import", handle.read())
            if source == model_module.__file__:  # what `angelspec_hf.models` does at import, for this copy
                code += "\n\nfrom .speculative import install  # noqa: E402\n\n\ninstall()\n"
            with open(os.path.join(directory, os.path.basename(source)), "w") as handle:
                handle.write(code)
        os.makedirs(os.path.join(directory, "custom_generate"), exist_ok=True)
        shutil.copyfile(
            os.path.join(os.path.dirname(package), "generation", "hub_generate.py"),
            os.path.join(directory, "custom_generate", "generate.py"),
        )
        return {
            "AutoConfig": f"{config_module.__name__.rsplit('.', 1)[-1]}.{type(self.config).__name__}",
            "AutoModel": f"{model_module.__name__.rsplit('.', 1)[-1]}.{type(self).__name__}",
        }

    @staticmethod
    def _set_auto_map(directory: str, auto_map: dict | None) -> None:
        """Name the remote code's classes in the folder's config.json, or (None) drop an `auto_map` the config was
        loaded with, so that a folder without code never points at code it lacks."""
        config_path = os.path.join(directory, "config.json")
        with open(config_path) as handle:
            config = json.load(handle)
        config.pop("auto_map", None)
        if auto_map is not None:
            config["auto_map"] = auto_map
        with open(config_path, "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, output_loading_info: bool = False, **kwargs):
        """Load a drafter. A missing or unreadable checkpoint raises an error that names the folder and file; one whose
        tensors are not exactly the drafter's (some missing, some unexpected) raises a `ValueError` naming them rather
        than drafting with randomly initialised weights."""
        path = str(pretrained_model_name_or_path)
        if os.path.isdir(path):
            for required in ("config.json", "model.safetensors"):
                if not os.path.isfile(os.path.join(path, required)) and not (
                    required == "model.safetensors"
                    and os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
                ):
                    raise FileNotFoundError(f"Drafter checkpoint {path!r} has no {required}")
        try:
            model, loading_info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except (OSError, ValueError, RuntimeError) as error:
            raise ValueError(f"Cannot load the drafter checkpoint {path!r}: {error}") from error
        except Exception as error:  # safetensors raises its own error type for corrupt files
            if type(error).__name__ == "SafetensorError":
                raise ValueError(f"Corrupt weights file in drafter checkpoint {path!r}: {error}") from error
            raise
        try:  # transformers loads it only for models that generate
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path)
        except OSError:  # saved before drafters kept their drafting settings: the defaults
            pass
        problems = [
            f"{kind} tensors: {', '.join(sorted(loading_info[f'{kind}_keys']))}"
            for kind in ("missing", "unexpected")
            if loading_info[f"{kind}_keys"]
        ]
        if problems:
            raise ValueError(
                f"Drafter checkpoint {path!r} does not hold the weights of a {type(model).__name__} with its config; "
                + "; ".join(problems)
            )
        return (model, loading_info) if output_loading_info else model

"""AngelSpec MTP drafter (AngelSpec §2, eq. 1-2) with training-time test (§2.2).

    u(k)   = W_proj [RMSNorm(h(k-1)); RMSNorm(E(x̃_k))]          (eq. 1)
    h(k)   = DecoderLayer(u(k))   (one layer, shared across depths)
    q_k    = softmax(W_lm RMSNorm(h(k)))                            (eq. 2)

h(0) is the target's last hidden state; each depth feeds the next. E and the full-vocabulary W_lm are the target's
own (frozen, shared); with a reduced draft vocabulary W_lm is the drafter's small head.

`input_layout="eagle3"` replaces eq. 1 by EAGLE-3's midlayer, whose attention reads [RMSNorm(E(x̃_k)); RMSNorm(h(k-1))]
(2H wide) with h(k-1) as the residual: the layout serving engines load as EAGLE-3 (`angelspec_hf.export`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.utils import ModelOutput, logging

from ...cache_utils import last_valid, ragged_valid, with_cache
from ..base import AngelSpecDrafterPreTrainedModel, DraftPredictions, DraftState, family_classes
from .configuration_mtp import AngelSpecMTPConfig


logger = logging.get_logger(__name__)


@dataclass
class MTPDrafterOutput(ModelOutput):
    """`last_hidden_state` is h(k) before the final norm (fed to the next depth); `logits` are over the draft vocab."""

    last_hidden_state: torch.Tensor | None = None
    features: torch.Tensor | None = None  # RMSNorm(h(k)), what the head reads
    logits: torch.Tensor | None = None
    past_key_values: DynamicCache | None = None


def causal_mask(query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, q, kv] mask (True = attend) for `query_length` new tokens after `key_length - query_length` cached."""
    past = key_length - query_length
    keys = torch.arange(key_length, device=device)
    queries = torch.arange(query_length, device=device)[:, None] + past
    return (keys[None, :] <= queries)[None, None]


class AngelSpecMTPDrafter(AngelSpecDrafterPreTrainedModel):
    config_class = AngelSpecMTPConfig

    def __init__(self, config: AngelSpecMTPConfig):
        super().__init__(config)
        layer_config = config.draft_layer_config(num_layers=1)
        family = family_classes(config.target_model_type)
        hidden_size, eps = config.hidden_size, layer_config.rms_norm_eps
        self.hidden_norm = family.rms_norm(hidden_size, eps=eps)
        self.embed_norm = family.rms_norm(hidden_size, eps=eps)
        num_taps = len(config.target_layer_ids)
        # EAGLE-3-style conditioning on several target layers: their concatenation projected to h(0).
        self.target_fusion = nn.Linear(num_taps * hidden_size, hidden_size, bias=False) if num_taps > 1 else None
        self.layer = family.decoder_layer(layer_config, layer_idx=0)
        if config.input_layout == "eagle3":
            # EAGLE-3's midlayer: q/k/v read [RMSNorm(E(x)); RMSNorm(h)] themselves; no W_proj, no input norm.
            self.fusion = None
            self.layer.input_layernorm = None
            attention = self.layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                narrow = getattr(attention, name)
                setattr(attention, name, nn.Linear(2 * hidden_size, narrow.out_features, bias=narrow.bias is not None))
        else:
            self.fusion = nn.Linear(2 * hidden_size, hidden_size, bias=False)  # W_proj of eq. 1
        self.rotary_emb = family.rotary_embedding(config=layer_config)
        self.norm = family.rms_norm(hidden_size, eps=eps)
        self.post_init()

    def default_num_draft_tokens(self) -> int:
        return self.config.num_depths

    def draft_layers(self) -> list[nn.Module]:
        return [self.layer]

    def condition(self, taps) -> torch.Tensor:
        """h(0) from the tapped target states (each [B, T, H]): the one state itself, or several projected to one."""
        return taps[0] if self.target_fusion is None else self.target_fusion(torch.cat(list(taps), dim=-1))

    def step(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        with_logits: bool = True,
    ) -> MTPDrafterOutput:
        """One depth for a chunk of positions.

        `hidden_states` [B, T, H] is h(k-1) (the target's, or the previous depth's); `input_ids` [B, T] are the
        target-vocabulary tokens x̃_k paired with it; `attention_mask` is a boolean [B, 1, T, T_past + T] mask
        (causal over the cache when omitted). `with_logits=False` skips the draft head (logits None): a round
        reading many verified tokens needs them at its last position only, and the head costs as much per position
        as the layer.
        """
        embeds = self.embed_tokens(input_ids)
        if past_key_values is None and use_cache:
            past_key_values = DynamicCache()
        if attention_mask is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            attention_mask = causal_mask(embeds.shape[1], past + embeds.shape[1], embeds.device)
        hidden = self.apply_layer(
            hidden_states,
            embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **with_cache(past_key_values),
            position_embeddings=self.rotary_emb(embeds, position_ids),
        )
        features = self.norm(hidden)
        return MTPDrafterOutput(
            last_hidden_state=hidden,
            features=features,
            logits=self.draft_logits(features) if with_logits else None,
            past_key_values=past_key_values,
        )

    def apply_layer(self, hidden_states: torch.Tensor, embeds: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """h(k) from h(k-1) and E(x̃_k): eq. 1 then the decoder layer, or EAGLE-3's midlayer (`config.input_layout`)."""
        if self.fusion is not None:
            fused = self.fusion(torch.cat([self.hidden_norm(hidden_states), self.embed_norm(embeds)], -1))
            return self.layer(fused, **layer_kwargs)
        wide = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden_states)], -1)
        hidden = hidden_states + self.layer.self_attn(wide, **layer_kwargs)[0]
        return hidden + self.layer.mlp(self.layer.post_attention_layernorm(hidden))

    # -- starting points ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def warm_start(self, target: PreTrainedModel) -> None:
        if self.fusion is None:
            raise ValueError(
                "warm_start copies the target's last layer, whose attention reads H-wide inputs; the eagle3 "
                "input_layout's reads 2H"
            )
        super().warm_start(target)

    @classmethod
    def from_other_layout(cls, pretrained_model_name_or_path, input_layout: str, **kwargs) -> "AngelSpecMTPDrafter":
        """A drafter of `input_layout` started from a trained drafter of another layout (`from_pretrained` with
        `kwargs`): every tensor the two layouts share by name and shape carries over (the taps' fusion, the norms of
        h and E(x), the MLP, `o_proj`, the draft head and its vocabulary); eq. 1's W_proj and the layer's input norm
        are dropped, and q/k/v — H wide in eq. 1, 2H in EAGLE-3's midlayer — start fresh. Training adapts the rest:
        the two layouts feed the layer different residuals, so the copy is a starting point, not the same drafter."""
        source = cls.from_pretrained(pretrained_model_name_or_path, **kwargs)
        if source.config.input_layout == input_layout:
            return source
        config = source.config.__class__.from_dict({**source.config.to_dict(), "input_layout": input_layout})
        drafter = cls(config).to(source.dtype)
        own = drafter.state_dict()
        shared = {
            name: value
            for name, value in source.state_dict().items()
            if name in own and own[name].shape == value.shape
        }
        drafter.load_state_dict(shared, strict=False)
        drafter.generation_config = source.generation_config
        fresh = sorted(set(own) - set(shared))
        logger.warning(
            f"Started a {input_layout} drafter from the {source.config.input_layout} drafter "
            f"{pretrained_model_name_or_path}: {len(shared)} tensors carried over, {len(fresh)} fresh ({', '.join(fresh)})"
        )
        return drafter

    @classmethod
    def from_native_mtp(cls, target: PreTrainedModel, tokenizer=None, **config_kwargs) -> "AngelSpecMTPDrafter":
        """A drafter that starts as the target's own MTP module (transformers' `MtpModel`: DeepSeek-V3, GLM-4.5 and
        the other models whose config sets `num_mtp_layers`), which computes eq. 1 already: its `eh_proj` is W_proj
        (input halves swapped where the native order is [E(x); h]), `enorm` / `hnorm` the two norms, the MTP block
        the layer (built as the block is, from `get_mtp_config()`) and its post norm the final norm. Depth 0 drafts
        exactly as the native module does; deeper depths read h(k) before the final norm (eq. 2's chain), where the
        native chain reads it after, and TTT training adapts them."""
        from transformers.modeling_layers import MtpModel

        text_config = target.config.get_text_config()
        if not getattr(text_config, "num_mtp_layers", None):
            raise ValueError(f"{type(target).__name__} has no native MTP layer (its config sets no num_mtp_layers)")
        last = text_config.num_hidden_layers - 1
        if config_kwargs.get("draft_vocab_size") or config_kwargs.get("target_layer_ids") not in (None, [last]):
            raise ValueError(
                "A native MTP layer reads the target's last layer and drafts over its full vocabulary: leave "
                "draft_vocab_size and target_layer_ids unset"
            )
        if config_kwargs.get("input_layout", "projection") != "projection":
            raise ValueError("A native MTP layer has eq. 1's projection input_layout")
        block_settings = text_config.get_mtp_config().to_dict()
        layer_settings = {key: value for key, value in block_settings.items() if key != "num_hidden_layers"}
        drafter = cls.from_target(target, tokenizer, layer_settings=layer_settings, **config_kwargs)
        native_model = MtpModel.from_pretrained(target, device_map={"": target.device})
        native = native_model.layers[0]
        final_norm = native.post_norm or getattr(native_model, "shared_post_norm", None) or target.get_decoder().norm
        projection = native.eh_proj.weight
        if not getattr(text_config, "mtp_hidden_states_first", False):
            hidden = drafter.config.hidden_size
            projection = torch.cat([projection[:, hidden:], projection[:, :hidden]], dim=1)
        pairs = {
            "embed_norm": (drafter.embed_norm, native.enorm),
            "hidden_norm": (drafter.hidden_norm, native.hnorm),
            "layer": (drafter.layer, native.mtp_block),
            "norm": (drafter.norm, final_norm),
        }
        with torch.no_grad():
            drafter.fusion.weight.copy_(projection)
            for name, (mine, native_module) in pairs.items():
                try:
                    mine.load_state_dict(native_module.state_dict())
                except RuntimeError as error:
                    raise ValueError(f"The target's MTP module does not fit the drafter's {name}: {error}") from error
        return drafter

    # -- training-time test (§2.2) --------------------------------------------------------------------------------

    def forward(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        document_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        num_draft_tokens: int | None = None,
    ) -> DraftPredictions:
        """Training forward: the TTT rollout, keeping the predictions that are supervised.

        Depth k at slot t predicts token t+k+2 against the target's distribution at position t+k+1: kept when that
        token is a response token (`loss_mask`) of the same document. In eval mode every depth is unrolled with
        greedy choices, so the predictions are the greedy draft chain of every slot (the offline acceptance estimate);
        a round drafting `num_draft_tokens` runs the same depths (the estimate reads the first that many).
        """
        length = input_ids.shape[1]
        logits, features, teacher_positions, draft_positions = [], [], [], []
        for depth, output in enumerate(self.rollout(target_hidden, input_ids, position_ids, document_ids)):
            span = length - depth - 2
            if span <= 0:
                break
            valid = loss_mask[:, depth + 2 :].bool() & (document_ids[:, :span] == document_ids[:, depth + 2 :])
            rows, slots = valid.nonzero(as_tuple=True)
            logits.append(output.logits[rows, slots])
            features.append(output.features[rows, slots])
            teacher_positions.append(rows * length + slots + depth + 1)
            draft_positions.append(torch.full_like(slots, depth + 1))
        return DraftPredictions(
            logits=torch.cat(logits),
            teacher_positions=torch.cat(teacher_positions),
            draft_positions=torch.cat(draft_positions),
            hidden_states=torch.cat(features) if self.config.hidden_regression_weight else None,
        )

    def draft_position_weights(self) -> torch.Tensor:
        if not self.config.training_time_test:  # only depth 0 is trained
            return torch.tensor([1.0] + [0.0] * (self.config.num_depths - 1))
        return torch.tensor(self.config.depth_loss_weights)

    def rollout(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        document_ids: torch.LongTensor,
    ) -> tuple[MTPDrafterOutput, ...]:
        """Training-time test: unroll the D depths over a (packed) sequence, as inference will run them.

        Slot t pairs the target state h_t with token x_{t+1}; depth k at slot t predicts x_{t+k+2}. Depth 0 reads the
        ground-truth token; depth k >= 1 reads the token the drafter chose at depth k-1 (`config.ttt_token_choice`)
        and its hidden state. A depth-k query attends to depth-0 keys of earlier slots of its document (causal) and
        to its own slot's keys at depths 1..k — exactly the cache layout of one inference round.
        `target_hidden` is [B, N, T, H] (the states of `target_hidden_state_indices` first). Returns every
        depth's output (draft-vocabulary logits [B, T-1, V_draft], features, states).
        """
        slots = input_ids.shape[1] - 1
        tokens = input_ids[:, 1:]
        positions = position_ids[:, 1:]
        # A slot whose h_t and x_{t+1} come from different documents never exists at inference: hide it.
        slot_docs = torch.where(document_ids[:, :-1] == document_ids[:, 1:], document_ids[:, 1:], -1)
        same_doc = (slot_docs[:, :, None] == slot_docs[:, None, :]) & (slot_docs[:, :, None] >= 0)
        causal = torch.ones(slots, slots, dtype=torch.bool, device=input_ids.device).tril()
        eye = torch.eye(slots, dtype=torch.bool, device=input_ids.device)
        depth0_keys = (same_doc & causal) | eye  # every query sees at least itself
        eye = eye.expand_as(depth0_keys)

        taps = [target_hidden[:, i, :-1] for i in range(len(self.config.target_layer_ids))]
        cache, hidden, outputs = DynamicCache(), self.condition(taps), []
        # Evaluation unrolls every depth inference drafts, also for the no-TTT ablation trained on depth 0 only.
        depths = self.config.num_depths if self.config.training_time_test or not self.training else 1
        for depth in range(depths):
            mask = torch.cat([depth0_keys] + [eye] * depth, dim=-1)[:, None]
            output = self.step(
                hidden, tokens, positions + depth, attention_mask=mask, past_key_values=cache, use_cache=True
            )
            outputs.append(output)
            hidden = output.last_hidden_state
            tokens = self._next_depth_tokens(output.logits.detach(), input_ids, depth)
        return tuple(outputs)

    def _next_depth_tokens(self, logits: torch.Tensor, input_ids: torch.LongTensor, depth: int) -> torch.LongTensor:
        """Token read by depth+1 at each slot: the drafter's own choice (TTT) or the ground truth x_{t+depth+2};
        in evaluation always the greedy choice, as greedy drafting makes it."""
        if not self.training:
            return self.to_target_ids(logits.argmax(-1))
        if self.config.ttt_token_choice == "ground_truth":
            shifted = input_ids[:, depth + 2 :]
            return torch.cat([shifted, shifted.new_zeros(shifted.shape[0], depth + 1)], dim=1)
        if self.config.ttt_token_choice == "sample":
            draft = torch.multinomial(logits.float().softmax(-1).flatten(0, 1), 1).view(logits.shape[:-1])
        else:
            draft = logits.argmax(-1)
        return self.to_target_ids(draft)

    # -- inference: one drafting round ----------------------------------------------------------------------------

    def target_hidden_state_indices(self) -> list[int]:
        """Which of the target's `hidden_states` the drafter reads: hidden_states[i + 1] is layer i's output (the
        last one is the final-normed state)."""
        return [i + 1 for i in self.config.target_layer_ids]

    @torch.no_grad()
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
        """Draft `num_tokens` tokens after the verified sequence of every row.

        `target_hidden` holds the target states of the newly verified positions (one tensor per index of
        `target_hidden_state_indices`), `new_token_ids` the tokens that follow each of them (the last is the bonus
        token); in a ragged batch only the first `new_lengths[r]` columns of row r are real. `choose` maps
        draft-vocabulary logits [B, V_draft] to draft-vocabulary ids [B]; `keep_drafting`, when given, is asked
        before each further depth and ends the round early when it says no.
        Returns target-vocabulary ids [B, num_tokens] and their draft logits [B, num_tokens, V_draft].
        """
        cache = state.cache
        state.begin_round()  # drops the last round's speculative depths
        batch, count = new_token_ids.shape
        new_valid = ragged_valid(new_lengths, batch, count, new_token_ids.device)
        positions = cache.position_ids(count, offset=1)  # slot t holds token x_{t+1}: its position is t + 1
        cache.append(new_valid)
        mask = cache.attention_mask(count)
        output = self.step(
            self.condition(target_hidden),
            new_token_ids,
            positions,
            attention_mask=mask,
            past_key_values=cache.cache,
            use_cache=True,
            with_logits=False,
        )
        state.commit()
        hidden, features, position = (
            last_valid(t, new_valid) for t in (output.last_hidden_state, output.features, positions)
        )
        logits = self.draft_logits(features)
        draft_ids, draft_logits = [], []
        for depth in range(num_tokens):
            token = self.to_target_ids(choose(logits[:, 0]))[:, None]
            draft_ids.append(token)
            draft_logits.append(logits[:, 0])
            if depth + 1 < num_tokens:
                if keep_drafting is not None and not keep_drafting():
                    break
                position = position + 1
                cache.append(new_valid.new_ones(batch, 1))
                mask = cache.attention_mask(1)
                output = self.step(
                    hidden, token, position, attention_mask=mask, past_key_values=cache.cache, use_cache=True
                )
                hidden, logits = output.last_hidden_state, output.logits
        if not draft_ids:
            return new_token_ids[:, :0], logits.new_zeros(batch, 0, logits.shape[-1])
        return torch.cat(draft_ids, 1), torch.stack(draft_logits, 1)

"""AngelSpec DFly drafter: block diffusion on DFlash, with hybrid conditioning and a predecessor-conditioned head.

One round: the block [x_b, MASK, ..., MASK] (x_b the last accepted token) goes through the draft layers in one
forward, bidirectional inside the block; every draft layer also attends to the target's hidden states of all
verified positions, injected as extra keys/values projected by that layer's own k/v projections (cached, and only
newly verified positions are projected each round). Block position k predicts x_{b+k}.

    ctx_i = RMSNorm_i(FC(concat_t H_t) + Σ_t softmax(w_i)_t H_t)        hybrid conditioning, draft layer i
    h'_k  = h_k + SwiGLU([RMSNorm(h_k); RMSNorm(E(x_{k-1}))])           predecessor-conditioned AR head

With `per_layer_context_mix=False` (ctx = RMSNorm(FC(concat H)) for every layer) and `ar_head=False` it is DFlash.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput

from ...cache_utils import last_valid, ragged_valid, with_cache
from ..base import AngelSpecDrafterPreTrainedModel, DraftPredictions, DraftState, family_classes
from .configuration_dfly import DFlyConfig


def project_key_value(attention: nn.Module, hidden: torch.Tensor, cos, sin, apply_rotary: Callable):
    """Keys and values of `hidden` through an attention module's own projections (k-norm and RoPE included)."""
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    key = attention.k_proj(hidden).view(shape)
    if hasattr(attention, "k_norm"):
        key = attention.k_norm(key)
    key = key.transpose(1, 2)
    value = attention.v_proj(hidden).view(shape).transpose(1, 2)
    key, _ = apply_rotary(key, key, cos, sin)
    return key, value


class DFlyContextFusion(nn.Module):
    """Target conditioning: a shared projection of the concatenated tapped states, plus (DFly) a learned per-layer
    mix of the raw layer views; normalised per draft layer."""

    def __init__(self, config: DFlyConfig, rms_norm: type[nn.Module], eps: float):
        super().__init__()
        num_taps, hidden_size = len(config.target_layer_ids), config.hidden_size
        self.num_draft_layers = config.num_draft_layers
        self.per_layer_mix = config.per_layer_context_mix
        self.fc = nn.Linear(num_taps * hidden_size, hidden_size, bias=False)
        num_norms = config.num_draft_layers if self.per_layer_mix else 1
        self.norms = nn.ModuleList(rms_norm(hidden_size, eps=eps) for _ in range(num_norms))
        # w_i of the hybrid conditioning; zero logits start as a uniform mix.
        self.layer_mix_logits = (
            nn.Parameter(torch.zeros(config.num_draft_layers, num_taps)) if self.per_layer_mix else None
        )

    def forward(self, taps: list[torch.Tensor]) -> list[torch.Tensor]:
        """`taps`: T tensors [B, S, H]. Returns ctx_i [B, S, H] for every draft layer i."""
        shared = self.fc(torch.cat(taps, dim=-1))
        if not self.per_layer_mix:
            return [self.norms[0](shared)] * self.num_draft_layers
        views = torch.stack(taps, dim=-2)  # [B, S, T, H]
        mix = self.layer_mix_logits.softmax(-1).to(views.dtype)
        return [norm(shared + torch.einsum("bsth,t->bsh", views, weights)) for norm, weights in zip(self.norms, mix)]


class DFlyPredecessorHead(nn.Module):
    """h'_k = h_k + SwiGLU([RMSNorm(h_k); RMSNorm(E(x_{k-1}))]); `down_proj` starts at zero, so it starts as DFlash."""

    def __init__(self, hidden_size: int, rms_norm: type[nn.Module], eps: float):
        super().__init__()
        self.hidden_norm = rms_norm(hidden_size, eps=eps)
        self.token_norm = rms_norm(hidden_size, eps=eps)
        self.gate_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.down_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.down_proj.zero_init = True  # read by DFlyDrafter._init_weights

    def forward(self, hidden: torch.Tensor, previous_embeds: torch.Tensor) -> torch.Tensor:
        fused = torch.cat([self.hidden_norm(hidden), self.token_norm(previous_embeds)], dim=-1)
        return hidden + self.down_proj(F.silu(self.gate_proj(fused)) * self.up_proj(fused))


class DFlyDrafter(AngelSpecDrafterPreTrainedModel):
    config_class = DFlyConfig

    def __init__(self, config: DFlyConfig):
        super().__init__(config)
        if config.mask_token_id is None:
            raise ValueError("DFly needs a mask_token_id: a token id of the target vocabulary that fills the block")
        layer_config = config.draft_layer_config(num_layers=config.num_draft_layers)
        family = family_classes(config.target_model_type)
        eps = layer_config.rms_norm_eps
        self.context = DFlyContextFusion(config, family.rms_norm, eps)
        self.layers = nn.ModuleList(
            family.decoder_layer(layer_config, layer_idx=i) for i in range(config.num_draft_layers)
        )
        self.rotary_emb = family.rotary_embedding(config=layer_config)
        self.norm = family.rms_norm(config.hidden_size, eps=eps)
        self.ar_head = DFlyPredecessorHead(config.hidden_size, family.rms_norm, eps) if config.ar_head else None
        self._apply_rotary = family.apply_rotary_pos_emb
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DFlyContextFusion) and module.layer_mix_logits is not None:
            init.zeros_(module.layer_mix_logits)
        if getattr(module, "zero_init", False):
            init.zeros_(module.weight)

    def default_num_draft_tokens(self) -> int:
        return self.config.block_size - 1

    def max_num_draft_tokens(self) -> int:
        return self.config.block_size - 1

    def draft_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def target_hidden_state_indices(self) -> list[int]:
        """hidden_states[i + 1] is the output of target layer i."""
        return [i + 1 for i in self.config.target_layer_ids]

    def draft_position_weights(self) -> torch.Tensor:
        """Block position k weighs exp(-(k-1)/γ): early positions decide how much of a block is accepted."""
        positions = torch.arange(self.config.block_size - 1, dtype=torch.float32)
        return torch.exp(-positions / self.config.position_decay_gamma)

    # -- shared by training and inference ---------------------------------------------------------------------------

    def write_context(self, cache: DynamicCache, taps: list[torch.Tensor], position_ids: torch.LongTensor) -> None:
        """Append the projected context of newly verified positions to every draft layer's cache."""
        contexts = self.context(list(taps))
        cos, sin = self.rotary_emb(contexts[0], position_ids)
        for layer_idx, (layer, context) in enumerate(zip(self.layers, contexts)):
            key, value = project_key_value(layer.self_attn, context, cos, sin, self._apply_rotary)
            cache.update(key, value, layer_idx)

    def run_block(self, block_embeds, position_ids, attention_mask, cache: DynamicCache) -> torch.Tensor:
        """The draft layers over the block, attending to the cached context (block keys are appended to it)."""
        hidden = block_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **with_cache(cache),
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden)

    def block_ids(self, anchors: torch.LongTensor, length: int) -> torch.LongTensor:
        """[..., length]: each anchor token followed by `length - 1` mask tokens."""
        masks = anchors.new_full((*anchors.shape, length - 1), self.config.mask_token_id)
        return torch.cat([anchors[..., None], masks], dim=-1)

    def head(self, hidden: torch.Tensor, previous_ids: torch.LongTensor) -> torch.Tensor:
        """Draft logits at block positions, conditioned on the previous position's token when the AR head is on."""
        if self.ar_head is not None:
            hidden = self.ar_head(hidden, self.embed_tokens(previous_ids))
        return self.draft_logits(hidden)

    # -- training ---------------------------------------------------------------------------------------------------

    def forward(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        document_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        num_draft_tokens: int | None = None,
    ) -> DraftPredictions:
        """Training forward on packed rows: `anchors_per_row` random blocks per row, drafted as inference does (in
        eval mode a block at every eligible anchor: with the ground-truth predecessor, each block's predictions up to
        its first miss are exactly greedy drafting's, which the offline acceptance estimate counts). A round drafting
        k tokens runs the anchor and k masks (`propose`): in eval mode `num_draft_tokens` sets k, so that the blocks
        are those of that round (default: the whole block).

        An anchor a is a verified token whose successor is a response token of its document; its block attends to
        the context of earlier positions of the same document and, bidirectionally, to itself. Block position k
        predicts x_{a+k} against the target's distribution at position a+k-1; the AR head reads the ground truth
        x_{a+k-1}. `target_hidden` is [B, taps + 1, T, H] (tapped layers, then the final state used as teacher).
        """
        cache = DynamicCache()
        taps = [target_hidden[:, i] for i in range(len(self.config.target_layer_ids))]
        self.write_context(cache, taps, position_ids)
        eligible = self.eligible_anchors(loss_mask, document_ids)
        block = self.config.block_size
        if num_draft_tokens is not None and not self.training:
            block = min(block, num_draft_tokens + 1)
        if self.training:
            chunks = [self.sample_anchors(eligible)]
        else:  # evaluation drafts a block from every eligible anchor, `anchors_per_row` at a time
            chunks = self.all_anchors(eligible)
        predictions = []
        for anchors, anchor_valid in chunks:
            predictions.append(
                self.predict_blocks(
                    anchors, anchor_valid, cache, input_ids, position_ids, document_ids, loss_mask, block
                )
            )
            cache.crop(-anchors.shape[1] * block)  # drop this chunk's block keys
        return DraftPredictions(**{key: torch.cat([chunk[key] for chunk in predictions]) for key in predictions[0]})

    def predict_blocks(
        self, anchors, anchor_valid, cache, input_ids, position_ids, document_ids, loss_mask, block
    ) -> DraftPredictions:
        """The supervised predictions of the blocks of `block` positions at `anchors` [B, A] (context already in
        `cache`)."""
        batch, length = input_ids.shape
        num_anchors = anchors.shape[1]
        offsets = torch.arange(block, device=input_ids.device)
        anchor_positions = position_ids.gather(1, anchors)  # [B, A]
        block_positions = (anchor_positions[..., None] + offsets).flatten(1)
        block_tokens = self.block_ids(input_ids.gather(1, anchors), block).flatten(1)
        mask = self.training_attention_mask(anchors, anchor_valid, document_ids, block)
        hidden = self.run_block(self.embed_tokens(block_tokens), block_positions, mask, cache)
        hidden = hidden.view(batch, num_anchors, block, -1)

        # Predictions k = 1..block-1 of each anchor: valid while inside the row, the document and the response.
        targets = anchors[..., None] + offsets[1:]  # [B, A, block-1]
        inside = targets < length
        targets = targets.clamp(max=length - 1)
        anchor_docs = document_ids.gather(1, anchors)[..., None]
        valid = (
            inside
            & anchor_valid[..., None]
            & (document_ids.gather(1, targets.flatten(1)).view_as(targets) == anchor_docs)
            & loss_mask.gather(1, targets.flatten(1)).view_as(targets).bool()
        )
        rows, anchor_index, k = valid.nonzero(as_tuple=True)
        target_positions = targets[rows, anchor_index, k]
        previous = input_ids[rows, target_positions - 1]
        logits = self.head(hidden[rows, anchor_index, k + 1], previous)
        return DraftPredictions(
            logits=logits, teacher_positions=rows * length + target_positions - 1, draft_positions=k + 1
        )

    @staticmethod
    def eligible_anchors(loss_mask, document_ids) -> torch.Tensor:
        """[B, T-1] bool: position a can anchor a block (a verified token, not its document's first, followed by a
        response token of its document)."""
        same_doc_next = document_ids[:, :-1] == document_ids[:, 1:]
        same_doc_previous = torch.cat([torch.zeros_like(same_doc_next[:, :1]), same_doc_next[:, :-1]], dim=1)
        return same_doc_next & same_doc_previous & loss_mask[:, 1:].bool() & (document_ids[:, :-1] >= 0)

    def sample_anchors(self, eligible) -> tuple[torch.LongTensor, torch.Tensor]:
        """Up to `anchors_per_row` random eligible anchors per row (padded with position 0, marked invalid)."""
        orders = [
            candidates[torch.randperm(len(candidates), device=candidates.device)]
            for candidates in self._candidates(eligible)
        ]
        return self._pad_anchors([order[: self.config.anchors_per_row].sort().values for order in orders], eligible)

    def all_anchors(self, eligible) -> list[tuple[torch.LongTensor, torch.Tensor]]:
        """Every eligible anchor, in chunks of `anchors_per_row` per row."""
        candidates = self._candidates(eligible)
        count = self.config.anchors_per_row
        num_chunks = max(1, -(-max(len(c) for c in candidates) // count))
        return [
            self._pad_anchors([c[i * count : (i + 1) * count] for c in candidates], eligible)
            for i in range(num_chunks)
        ]

    @staticmethod
    def _candidates(eligible) -> list[torch.LongTensor]:
        return [row.nonzero()[:, 0] for row in eligible]

    def _pad_anchors(self, chosen: list[torch.LongTensor], eligible) -> tuple[torch.LongTensor, torch.Tensor]:
        batch, count = len(chosen), self.config.anchors_per_row
        anchors = torch.zeros(batch, count, dtype=torch.long, device=eligible.device)
        valid = torch.zeros(batch, count, dtype=torch.bool, device=eligible.device)
        for row, positions in enumerate(chosen):
            anchors[row, : len(positions)] = positions
            valid[row, : len(positions)] = True
        return anchors, valid

    def training_attention_mask(self, anchors, anchor_valid, document_ids, block) -> torch.Tensor:
        """[B, 1, A·block, T + A·block]: a block sees earlier context of its document, and all of its own block."""
        batch, num_anchors = anchors.shape
        length = document_ids.shape[1]
        keys = torch.arange(length, device=anchors.device)
        anchor_docs = document_ids.gather(1, anchors)
        context = (keys < anchors[..., None]) & (document_ids[:, None, :] == anchor_docs[..., None])  # [B, A, T]
        context = context & anchor_valid[..., None]
        own_block = torch.eye(num_anchors, dtype=torch.bool, device=anchors.device)
        blocks = own_block.repeat_interleave(block, 0).repeat_interleave(block, 1)  # [A·block, A·block]
        context = context.repeat_interleave(block, dim=1)  # [B, A·block, T]
        return torch.cat([context, blocks.expand(batch, -1, -1)], dim=-1)[:, None]

    # -- inference: one drafting round ------------------------------------------------------------------------------

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
        """Draft up to `num_tokens` (at most `block_size - 1`) tokens after the verified sequence of every row in one
        backbone forward over the anchor and `num_tokens` masks.

        `target_hidden` holds the tapped states of the newly verified positions, `new_token_ids` the tokens after
        each (the last real one is the bonus token, the block's anchor); in a ragged batch only the first
        `new_lengths[r]` columns of row r are real. Only the AR head and the draft head run sequentially over the
        block; `keep_drafting`, when given, is asked before each further position of that sequential part and ends
        it early when it says no. Returns target-vocabulary ids [B, ≤ num_tokens] and draft logits.
        """
        if num_tokens > self.config.block_size - 1:
            raise ValueError(
                f"num_tokens {num_tokens} exceeds the block of {self.config.block_size} (anchor included)"
            )
        cache = state.cache
        state.begin_round()  # drops the last round's block
        batch, count = new_token_ids.shape
        new_valid = ragged_valid(new_lengths, batch, count, new_token_ids.device)
        positions = cache.position_ids(count)
        cache.append(new_valid)
        self.write_context(cache.cache, target_hidden, positions)
        state.commit()
        if num_tokens == 0:
            return new_token_ids[:, :0], self.draft_logits(self.norm(target_hidden[0][:, :0]))
        anchor = last_valid(new_token_ids, new_valid)[:, 0]
        # The anchor and only the `num_tokens` masks whose states are read: the block's later masks, which the
        # bidirectional attention lets the earlier ones see, moved the drafts little (dfly-more, 8 GSM8K test
        # prompts: τ 1.675 with them, 1.672 without at 2 drafts a round; 1.811 / 1.807 at 4) and cost a forward
        # over all 16 positions (drafting 15 -> 10 ms a round at 2 drafts on the 2-core machine)
        block = num_tokens + 1
        positions = cache.position_ids(block)
        cache.append(new_valid.new_ones(batch, block))
        mask = cache.attention_mask(block, causal=False)  # bidirectional inside the block
        hidden = self.run_block(self.embed_tokens(self.block_ids(anchor, block)), positions, mask, cache.cache)
        return self.draft_tokens(hidden[:, 1 : num_tokens + 1], anchor, choose, keep_drafting)

    def draft_tokens(
        self, hidden: torch.Tensor, anchor: torch.LongTensor, choose, keep_drafting=None
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Tokens of the block positions from their backbone states: vectorised for DFlash, sequential through the
        AR head for DFly (position k reads the token chosen at k-1)."""
        num_tokens = hidden.shape[1]
        if self.ar_head is None:  # positions are independent: one vectorised head call
            logits = self.draft_logits(hidden)
            draft_ids = torch.stack([choose(logits[:, k]) for k in range(num_tokens)], dim=1)
            return self.to_target_ids(draft_ids), logits
        previous, draft_ids, draft_logits = anchor, [], []
        for k in range(num_tokens):
            if k and keep_drafting is not None and not keep_drafting():
                break
            logits = self.head(hidden[:, k], previous)
            token = choose(logits)
            previous = self.to_target_ids(token)
            draft_ids.append(previous)
            draft_logits.append(logits)
        return torch.stack(draft_ids, 1), torch.stack(draft_logits, 1)

    # -- transformers' built-in DFlash path -------------------------------------------------------------------------

    def as_transformers_dflash(self) -> "TransformersDFlashAssistant":
        """This drafter behind the drafter contract of transformers' `DFlashTokenCandidateGenerator`, for
        `target.generate(..., assistant_model=drafter.as_transformers_dflash(), speculation_type="dflash")`.

        Only the DFlash configuration fits that contract (no per-layer mix, no AR head), and transformers applies
        the target's full lm_head, so a reduced draft vocabulary is not used there.
        """
        if self.config.per_layer_context_mix or self.config.ar_head:
            raise ValueError(
                "transformers' DFlash path runs DFlash only: set per_layer_context_mix=False and ar_head=False"
            )
        return TransformersDFlashAssistant(self)


class TransformersDFlashAssistant(nn.Module):
    """Adapter: `forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache)` as transformers'
    DFlash candidate generator calls it (`past_key_values` for the cache before 5.25), computed by the wrapped
    drafter's own layers."""

    def __init__(self, drafter: DFlyDrafter):
        super().__init__()
        self.drafter = drafter
        self.config = drafter.config

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @torch.no_grad()
    def forward(
        self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, cache=None, past_key_values=None
    ):
        """`context_hidden_states` [1, n, taps·H] of the newly verified positions, then the block of `noise_embeds`;
        `position_ids` cover both. The block's keys stay in the cache: the generator crops them next round."""
        drafter, cache = self.drafter, cache if cache is not None else past_key_values
        new = context_hidden_states.shape[1]
        taps = context_hidden_states.split(drafter.config.hidden_size, dim=-1)
        drafter.write_context(cache, taps, position_ids[:, :new])
        block = noise_embeds.shape[1]
        everything = torch.ones(
            1, 1, block, cache.get_seq_length() + block, dtype=torch.bool, device=noise_embeds.device
        )
        hidden = drafter.run_block(noise_embeds.to(drafter.dtype), position_ids[:, new:], everything, cache)
        return BaseModelOutput(last_hidden_state=hidden)

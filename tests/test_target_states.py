"""The target states a drafter reads, hooked on the layers that make them (`TargetStateTaps`), are the tensors
transformers' `output_hidden_states` gives, for every family the package supports."""

import pytest
import torch
from conftest import ARCHITECTURES, make_target

from angelspec_hf.cache_utils import growing_cache, with_cache
from angelspec_hf.generation.target_states import TargetStateTaps


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_hooked_states_equal_output_hidden_states_in_a_prefill_and_a_cached_forward(model_type):
    target = make_target(model_type, num_hidden_layers=3)
    indices = [3, 0, 2, 1]  # the last (after the final norm), the embeddings, and two layers' outputs, in any order
    taps = TargetStateTaps(target, indices)
    assert taps.hooked and taps.forward_kwargs() == {"output_hidden_states": False}
    ids = torch.tensor([[5, 8, 13, 21, 34], [3, 1, 4, 1, 5]])
    expected = target(input_ids=ids, output_hidden_states=True).hidden_states  # the whole sequence at once
    cache = growing_cache()
    for start, end in ((0, 4), (4, 5)):  # a prefill, then a forward over the cache
        with taps.capturing():
            out = target(input_ids=ids[:, start:end], **with_cache(cache), use_cache=True)
        for index, state in zip(indices, taps.states(out)):
            torch.testing.assert_close(state, expected[index][:, start:end], msg=f"index {index}")


def test_hooks_live_only_inside_capturing_and_a_bad_index_is_named():
    target = make_target("llama", num_hidden_layers=2)
    taps = TargetStateTaps(target, [0, 2])
    layers = target.get_decoder().layers
    with taps.capturing():
        assert layers[0]._forward_pre_hooks and target.get_decoder().norm._forward_hooks
    assert not layers[0]._forward_pre_hooks and not target.get_decoder().norm._forward_hooks
    with pytest.raises(ValueError, match=r"hidden state indices \[0, 3\] outside 0..2"):
        TargetStateTaps(target, [0, 3])


def test_a_decoder_of_another_layout_is_read_through_output_hidden_states(monkeypatch):
    target = make_target("llama", num_hidden_layers=2)
    monkeypatch.delattr(target.get_decoder(), "norm")
    taps = TargetStateTaps(target, [2, 0])
    monkeypatch.undo()
    assert not taps.hooked and taps.forward_kwargs() == {"output_hidden_states": [2, 0]}
    ids = torch.tensor([[5, 8, 13]])
    with taps.capturing():
        out = target(input_ids=ids, **taps.forward_kwargs())
    expected = target(input_ids=ids, output_hidden_states=True).hidden_states
    for index, state in zip([2, 0], taps.states(out)):
        torch.testing.assert_close(state, expected[index])


def test_transformers_loop_reads_hooked_states_and_leaves_no_hook_behind(on_transformers_loop):
    """On transformers' assisted loop the candidate generator hooks the tapped layers for its lifetime: outputs
    equal plain decoding, no hook stays on the target once `generate()` returns, and a caller who asked for the
    hidden states still gets every layer's."""
    import gc

    from angelspec_hf import AngelSpecMTPDrafter

    target = make_target("qwen3", num_hidden_layers=3)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    prompt = torch.tensor([[5, 8, 13, 21, 34, 55]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter), expected)
    gc.collect()
    decoder = target.get_decoder()
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in decoder.layers)
    assert not decoder.norm._forward_hooks
    out = target.generate(
        prompt,
        max_new_tokens=4,
        do_sample=False,
        assistant_model=drafter,
        output_hidden_states=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected[:, : prompt.shape[1] + 4])
    assert all(state is not None for step in out.hidden_states for state in step)
    assert len(out.hidden_states[0]) == target.config.num_hidden_layers + 1

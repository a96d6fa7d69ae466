"""What every drafter family must do, tested the same way for each (as transformers' `ModelTesterMixin`): MTP (two
input layouts), DFly and its DFlash configuration, the suffix drafter and the router. Family-specific behaviour is
in test_modeling_mtp.py, test_modeling_dfly.py, test_suffix.py and test_router.py."""

import copy
import glob
import hashlib
import json
import os

import pytest
import torch
from conftest import ARCHITECTURES, make_target
from transformers import AutoConfig, AutoModel

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, RouterDrafter, SuffixDrafter
from angelspec_hf.generation.engine import Request, SpeculativeEngine


CARDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards")


class DrafterTesterMixin:
    """Subclasses name the family (`drafter_class`, `drafter_kwargs`, and where it differs how it is made, what it
    refuses and whether it has a draft head); every test here runs for each."""

    drafter_class: type
    drafter_kwargs: dict
    reduced_vocabulary = True  # a draft head over the most frequent target tokens (`draft_vocab_size`) applies
    refused_in_generate = "does not match the target"  # the error of generate() with the last mismatched target
    own_remote_code = True  # False: a configuration of another family's classes, whose remote code is tested there

    def make(self, target, tokenizer=None, **overrides):
        torch.manual_seed(0)
        return self.drafter_class.from_target(target, tokenizer, **{**self.drafter_kwargs, **overrides})

    def make_reduced(self, target, size: int):
        """A drafter whose draft head covers `size` target tokens (a plain one for a family without a head)."""
        if not self.reduced_vocabulary:
            return self.make(target)
        drafter = self.make(target, draft_vocab_size=size)
        for model in [drafter, *getattr(drafter, "members", [])]:
            if model.config.draft_vocab_size:
                model.init_draft_vocab(torch.arange(target.config.vocab_size).double(), always_keep=[0])
        return drafter

    def mismatched_targets(self) -> list[tuple]:
        """Targets this family's drafter (made for a 4-layer Llama, seed 0) refuses, each with what the error names."""
        return [
            (make_target("llama", num_hidden_layers=4, hidden_size=32, head_dim=8), "hidden_size"),
            (make_target("qwen2", num_hidden_layers=4, seed=0), "model_type"),
            (make_target("llama", num_hidden_layers=4, seed=1), "embedding differs"),  # same shapes, other weights
        ]

    def test_save_and_load_round_trip_with_generation_config(self, tmp_path):
        target = make_target("qwen2", num_hidden_layers=4)
        drafter = self.make_reduced(target, 40)
        drafter.record_output([1, 2, 3, 4, 5, 1, 2])  # what a suffix index keeps (no-op where there is none)
        drafter.generation_config.update(num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic")
        with torch.no_grad():  # no zero-initialised parameter may hide a tensor that is not saved or loaded
            for parameter in drafter.parameters():
                parameter.normal_(0.0, 0.02)
        drafter.save_pretrained(tmp_path)
        assert not glob.glob(f"{tmp_path}/**/*.py", recursive=True)  # no code beside the weights unless published
        assert isinstance(AutoConfig.from_pretrained(tmp_path), type(drafter.config))
        loaded = AutoModel.from_pretrained(tmp_path, dtype=torch.float64)
        assert type(loaded) is self.drafter_class
        provenance = {"_name_or_path", "auto_map", "transformers_version", "dtype", "target_config"}
        saved, restored = (  # as JSON has them (a router's member configs hold dicts with integer keys)
            json.loads(json.dumps({k: v for k, v in model.config.to_dict().items() if k not in provenance}))
            for model in (drafter, loaded)
        )
        assert restored == saved and loaded.config.target_config["hidden_size"] == target.config.hidden_size
        assert loaded.generation_config.num_assistant_tokens == 2
        assert loaded.generation_config.num_assistant_tokens_schedule == "heuristic"
        assert list(drafter.state_dict()) == list(loaded.state_dict())
        for (name, ours), (_, theirs) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
            torch.testing.assert_close(ours, theirs, msg=name)
        prompt = torch.tensor([[3, 5, 7, 9]])
        expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(
            target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=loaded), expected
        )

    def test_generates_with_remote_code_where_the_package_is_missing(self, tmp_path, packageless_python):
        """Loaded with `trust_remote_code=True` in a process that cannot import angelspec_hf (shared with the other
        families' remote code, as one user session loading several), the drafter drafts in
        `generate(assistant_model=...)` (one sequence, and a padded batch through the engine) and through its
        folder's `custom_generate/generate.py`; every output equals the target's plain greedy decoding."""
        if not self.own_remote_code:
            pytest.skip("the same classes and remote code as the family's default configuration, tested there")
        target = make_target("llama", num_hidden_layers=4, dtype=torch.float32)
        target.save_pretrained(tmp_path / "target")
        drafter = self.make_reduced(target, 32)
        for prompt in ([3, 5, 7, 9, 11], [3, 5, 7, 9], [4, 8, 2, 6, 1]):  # a suffix index drafts what it has seen
            drafter.record_output(target.generate(torch.tensor([prompt]), max_new_tokens=16)[0].tolist())
        drafter.generation_config.update(num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
        drafter.save_pretrained(tmp_path / "drafter", remote_code=True)
        code = f"""
import torch
from transformers import AutoModel, AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
drafter = AutoModel.from_pretrained({str(tmp_path / "drafter")!r}, trust_remote_code=True)
print(type(drafter).__name__, type(drafter).__module__.startswith("transformers_modules"))
single = torch.tensor([[3, 5, 7, 9, 11]])
batch = dict(input_ids=torch.tensor([[0, 3, 5, 7, 9], [4, 8, 2, 6, 1]]), attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
options = dict(max_new_tokens=16, do_sample=False)
for inputs in (dict(input_ids=single), batch):
    plain = target.generate(**inputs, **options)
    print(torch.equal(target.generate(**inputs, assistant_model=drafter, **options), plain))
    print(sum(drafter.speculation_stats.drafted) > 0)
print(torch.equal(target.generate(input_ids=single, custom_generate={str(tmp_path / "drafter")!r}, trust_remote_code=True,
      assistant_model={str(tmp_path / "drafter")!r}, **options), target.generate(input_ids=single, **options)))
"""
        printed, error = packageless_python.run(code)
        assert error is None, error
        assert printed.split()[-7:] == [self.drafter_class.__name__] + ["True"] * 6

    def test_a_mismatched_target_is_refused_with_a_clear_error(self):
        drafter = self.make(make_target("llama", num_hidden_layers=4, seed=0))
        mismatched = self.mismatched_targets()
        for target, named in mismatched:
            with pytest.raises(ValueError, match=named):
                drafter.bind_target(target)
        with pytest.raises(ValueError, match=self.refused_in_generate):
            mismatched[-1][0].generate(torch.tensor([[1, 2]]), max_new_tokens=2, assistant_model=drafter)

    def test_a_different_tokenizer_is_refused(self, smollm2_tokenizer):
        target = make_target("llama", num_hidden_layers=4, vocab_size=len(smollm2_tokenizer))
        drafter = self.make(target, smollm2_tokenizer)
        drafter.bind_target(target, smollm2_tokenizer)  # the right one is accepted
        other = copy.deepcopy(smollm2_tokenizer)
        other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
        with pytest.raises(ValueError, match="tokenizer differs"):
            drafter.bind_target(target, other)

    def test_an_interrupted_save_leaves_the_previous_checkpoint_intact(self, tmp_path, monkeypatch):
        drafter = self.make(make_target("llama", num_hidden_layers=4))
        drafter.save_pretrained(tmp_path)

        def contents():  # every file of the folder, subfolders (custom_generate/) included
            return {path.relative_to(tmp_path): path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}

        before = contents()
        with torch.no_grad():
            for parameter in list(drafter.parameters())[:1]:
                parameter.add_(1.0)
        drafter.record_output([9, 8, 7])  # what a suffix index saves changes too

        def crash(*args, **kwargs):
            raise KeyboardInterrupt("power cut while writing weights")

        monkeypatch.setattr("transformers.modeling_utils.safe_save_file", crash)
        with pytest.raises(KeyboardInterrupt):
            drafter.save_pretrained(tmp_path)
        assert contents() == before
        assert not [name for name in os.listdir(tmp_path.parent) if ".saving-" in name]

    @pytest.mark.parametrize("model_type", ARCHITECTURES)
    def test_greedy_output_is_the_targets_for_every_architecture(self, model_type):
        target = make_target(model_type, num_hidden_layers=4, seed=3)
        drafter = self.make(target)
        for schedule in ("dcut", "constant", "heuristic"):
            drafter.generation_config.num_assistant_tokens_schedule = schedule
            for prompt in (torch.tensor([[7]]), torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])):
                expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
                output = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter)
                assert torch.equal(output, expected), (model_type, schedule)

    def test_a_batch_decodes_as_each_request_alone(self):
        target = make_target("llama", num_hidden_layers=4, seed=5)
        drafter = self.make(target)
        prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [44, 2]]
        solo = [
            target.generate(torch.tensor([p]), max_new_tokens=15, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
        engine = SpeculativeEngine(target, drafter, max_batch_size=3)
        outputs = engine.generate([Request(p, max_new_tokens=15) for p in prompts])
        assert [o.output_ids for o in outputs] == solo


class TestMTP(DrafterTesterMixin):
    drafter_class = AngelSpecMTPDrafter
    drafter_kwargs = dict(num_depths=3)


class TestMTPEagle3Layout(DrafterTesterMixin):
    drafter_class = AngelSpecMTPDrafter
    drafter_kwargs = dict(num_depths=3, input_layout="eagle3")
    own_remote_code = False


class TestDFly(DrafterTesterMixin):
    drafter_class = DFlyDrafter
    drafter_kwargs = dict(block_size=6, num_draft_layers=2, mask_token_id=5, num_target_layers_tapped=2)


class TestDFlash(DrafterTesterMixin):
    drafter_class = DFlyDrafter
    drafter_kwargs = dict(
        block_size=6,
        num_draft_layers=2,
        mask_token_id=5,
        num_target_layers_tapped=2,
        per_layer_context_mix=False,
        ar_head=False,
    )
    own_remote_code = False


class TestSuffix(DrafterTesterMixin):
    drafter_class = SuffixDrafter
    drafter_kwargs = dict(min_match_length=2)
    reduced_vocabulary = False  # no weights: it drafts what its index of earlier text says
    refused_in_generate = "different tokenizers"  # transformers tells another vocabulary before the drafter binds

    def mismatched_targets(self):  # it reads only token ids: any target of the same vocabulary serves
        return [(make_target("llama", num_hidden_layers=4, vocab_size=64), "vocab_size")]


class TestRouter(DrafterTesterMixin):
    drafter_class = RouterDrafter
    drafter_kwargs = {}

    def make(self, target, tokenizer=None, **overrides):
        """MTP, DFly and suffix members (`overrides`, a draft head, for the two with one)."""
        members = [
            TestMTP().make(target, tokenizer, **overrides),
            TestDFly().make(target, tokenizer, **overrides),
            TestSuffix().make(target, tokenizer),
        ]
        return RouterDrafter.from_members(members)


def test_model_cards_hold_no_code_and_no_weights_twice():
    """A committed card is a Hub repository as usually laid out: config, generation config, weights, the target's
    tokenizer, card and results, no copy of the package's code (that is written when a drafter is published:
    `save_pretrained(..., remote_code=True)`, `push_to_hub`), and no weight file that another card already holds."""
    files = [os.path.join(root, name) for root, _, names in os.walk(CARDS) for name in names]
    assert files and not [name for name in files if name.endswith(".py")]
    for path in glob.glob(f"{CARDS}/**/config.json", recursive=True):
        with open(path) as handle:
            assert "auto_map" not in handle.read(), f"{path} points at remote code it does not hold"
        assert os.path.isfile(os.path.join(os.path.dirname(path), "generation_config.json")), path  # drafting settings
        with open(path) as handle:
            assert json.load(handle)["architectures"], f"{path}: pipelines resolve the class from it"
        assert os.path.isfile(os.path.join(os.path.dirname(path), "tokenizer.json")), (
            path
        )  # the target's, for pipelines
    digests = {}
    for path in glob.glob(f"{CARDS}/**/*.safetensors", recursive=True):
        with open(path, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        assert digest not in digests, f"{path} repeats {digests.get(digest)}"
        digests[digest] = path

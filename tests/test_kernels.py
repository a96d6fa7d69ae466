"""Linear layers tuned per row count give `F.linear`'s outputs, cache their plan per machine, and leave training and
speculative decoding as they were."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import errors_of_concurrent_calls, make_target
from oracles import OracleMTPDrafter
from torch import nn

from angelspec_hf.generation import kernels, measurements, verify_cost
from angelspec_hf.generation.kernels import (
    LinearKernelPlan,
    TunedLinear,
    tune_linear_kernels,
    untune_linear_kernels,
)
from angelspec_hf.generation.measurements import installed_plan


def plan_of(choices, max_rows=4):
    """A plan with these choices (the seconds it would be chosen from do not matter to a forward)."""
    return LinearKernelPlan(max_rows, {name: [1.0] * max_rows for name in kernels.KERNELS}, {}, choices)


def saved_plan(tmp_path, choices, max_rows=kernels.MAX_ROWS):
    path = str(tmp_path / "plan.json")
    plan_of(choices, max_rows).save(path)
    return path


@pytest.mark.parametrize("bias", [True, False])
def test_a_tuned_linear_gives_f_linears_output_at_every_row_count(bias):
    layer = nn.Linear(7, 5, bias=bias).double()
    reference = nn.Linear(7, 5, bias=bias).double()
    reference.load_state_dict(layer.state_dict())
    layer.__class__, layer.kernel_plan = TunedLinear, plan_of({1: ("w_xt", 2), 2: ("w_xt", 2), 3: ("x_wt", 4)})
    for shape in [(1, 7), (2, 7), (1, 3, 7), (2, 2, 7), (5, 7), (0, 7)]:  # padded, transposed, default, beyond, none
        x = torch.randn(*shape, dtype=torch.float64)
        with torch.no_grad():
            output = layer(x)
            assert output.shape == F.linear(x, reference.weight).shape and output.is_contiguous()
            torch.testing.assert_close(output, reference(x))


needs_mkl_packing = pytest.mark.skipif(
    "mkl_packed" not in kernels.KERNELS, reason="this PyTorch build has no MKL packed GEMM"
)


@needs_mkl_packing
@pytest.mark.parametrize("bias", [True, False])
def test_the_mkl_packed_kernel_gives_f_linears_output_and_follows_every_change_of_the_weight(bias):
    layer = nn.Linear(24, 40, bias=bias)
    layer.__class__, layer.kernel_plan = TunedLinear, plan_of({rows: ("mkl_packed", rows) for rows in (1, 3, 4)})
    reference = lambda x: F.linear(x, layer.weight, layer.bias)  # noqa: E731
    with torch.no_grad():
        for shape in [(1, 24), (3, 24), (2, 2, 24), (5, 24)]:  # packed, packed, packed (4 rows), beyond the plan
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), reference(x))
        x = torch.randn(4, 24)
        layer.weight.mul_(-2.0)  # an in-place update (an optimizer step)
        torch.testing.assert_close(layer(x), reference(x))
        layer.load_state_dict({name: torch.randn_like(value) for name, value in layer.state_dict().items()})
        torch.testing.assert_close(layer(x), reference(x))
        layer.weight.data = torch.randn(40, 24)  # new storage
        torch.testing.assert_close(layer(x), reference(x))
        assert torch.equal(
            kernels.KERNELS["mkl_packed"](x.double(), layer.weight.double()), x.double() @ layer.weight.double().t()
        )


@needs_mkl_packing
def test_packed_copies_stay_out_of_copies_and_pickles_and_go_with_their_plan(tmp_path):
    import copy
    import gc
    import pickle

    target = make_target("llama", dtype=torch.float32)
    weights = [m.weight for m in target.modules() if isinstance(m, nn.Linear)]
    tune_linear_kernels(target, path=saved_plan(tmp_path, {rows: ("mkl_packed", rows) for rows in range(1, 5)}))
    prompt = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        logits = target(prompt).logits  # 4 rows through every layer: every weight packed
    assert all(id(weight) in kernels._PACKED for weight in weights)
    twin = copy.deepcopy(target)
    pickle.loads(pickle.dumps(target))
    with torch.no_grad():
        torch.testing.assert_close(twin(prompt).logits, logits)
    twin_keys = [id(m.weight) for m in twin.modules() if isinstance(m, nn.Linear)]
    assert all(key in kernels._PACKED for key in twin_keys)
    del twin
    gc.collect()
    assert not any(key in kernels._PACKED for key in twin_keys)  # an entry goes with its weight
    untune_linear_kernels(target)
    assert not any(id(weight) in kernels._PACKED for weight in weights)


@needs_mkl_packing
def test_a_measured_plan_that_does_not_pack_keeps_no_packed_copies(monkeypatch):
    target = make_target("llama", dtype=torch.float32)
    weights = [m.weight for m in target.modules() if isinstance(m, nn.Linear)]
    monkeypatch.setattr(LinearKernelPlan, "from_seconds", classmethod(lambda cls, seconds, machine: plan_of({})))
    kernels.measure_linear_kernels(target, max_rows=4, repeats=1)
    assert not any(id(weight) in kernels._PACKED for weight in weights)


def test_the_plan_takes_a_larger_row_count_or_the_other_kernel_only_when_it_is_faster_by_the_margin():
    seconds = {
        "x_wt": [0.050, 0.080, 0.100, 0.070, 0.060],
        "w_xt": [0.049, 0.020, 0.030, 0.069, 0.100],
    }
    plan = LinearKernelPlan.from_seconds(seconds, {"threads": 2})
    # 1 row: w_xt padded to 2 (0.020); 2: w_xt; 3: w_xt (padding goes up only, so 2's 0.020 is out of reach);
    # 4: x_wt padded to 5 (0.060 against 0.070); 5: nothing beats x_wt's own 0.060
    assert plan.choices == {1: ("w_xt", 2), 2: ("w_xt", 2), 3: ("w_xt", 3), 4: ("x_wt", 5)}
    assert plan.max_rows == 5 and plan.fingerprint() != plan_of({}).fingerprint()
    close = LinearKernelPlan.from_seconds({"x_wt": [0.050], "w_xt": [0.048]}, {})
    assert close.choices == {}  # 4 % faster is within the margin: the default stays


def test_tuning_turns_every_linear_into_a_tuned_one_and_untuning_restores_them(tmp_path):
    target = make_target("qwen2")
    state = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    plain_path = verify_cost.cost_model_path(target)
    plan = tune_linear_kernels(target, path=saved_plan(tmp_path, {1: ("w_xt", 2)}))
    linears = [m for m in target.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is TunedLinear for m in linears) and installed_plan(target) == plan
    assert verify_cost.cost_model_path(target) != plain_path  # D-cut's profile is of the tuned model
    assert measurements.machine_description(target)["linear_kernels"] == plan.fingerprint()
    untune_linear_kernels(target)
    assert all(type(m) is nn.Linear for m in linears) and installed_plan(target) is None
    assert verify_cost.cost_model_path(target) == plain_path
    assert all(torch.equal(state[name], tensor) for name, tensor in target.state_dict().items())


def test_a_cached_plan_is_reused_and_an_unreadable_or_unmeant_one_is_measured_again(
    tmp_path, monkeypatch, package_log
):
    target = make_target("llama", dtype=torch.float32)
    path = saved_plan(tmp_path, {2: ("w_xt", 3)})
    measured = []
    real_measure = kernels.measure_linear_kernels
    monkeypatch.setattr(
        kernels,
        "measure_linear_kernels",
        lambda model, max_rows: measured.append(max_rows) or real_measure(model, max_rows, 1),
    )
    assert tune_linear_kernels(target, path=path).choices == {2: ("w_xt", 3)} and measured == []
    with open(path, "w") as file:
        json.dump({"max_rows": 4, "seconds": {}, "machine": {}, "choices": [[2, ["mystery", 3]]]}, file)
    with package_log.warns("unreadable"):
        plan = tune_linear_kernels(target, path=path)
    assert measured == [kernels.MAX_ROWS] and plan.max_rows == kernels.MAX_ROWS
    assert LinearKernelPlan.load(path) == plan  # the new measurement replaced the bad file
    with package_log.silent():
        tune_linear_kernels(target, path=path, measure=True)  # asked for: measured again, silently
    assert measured == [kernels.MAX_ROWS] * 2
    older = LinearKernelPlan(kernels.MAX_ROWS, {"x_wt": [1.0] * kernels.MAX_ROWS}, {}, {})
    older.save(path)  # timed without this build's other kernels (an older package's plan)
    with package_log.silent():
        assert set(tune_linear_kernels(target, path=path).seconds) == set(kernels.KERNELS)
    assert measured == [kernels.MAX_ROWS] * 3


def test_training_through_tuned_linears_takes_f_linear_and_its_gradients(tmp_path):
    layer = nn.Linear(6, 3).double()
    tune_linear_kernels(layer, path=saved_plan(tmp_path, {1: ("w_xt", 2), 2: ("w_xt", 2)}))
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    layer(x).square().sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    F.linear(expected, layer.weight.detach(), layer.bias.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)
    assert layer.weight.grad is not None


def test_speculative_decoding_on_a_tuned_target_with_its_drafter_following_equals_its_plain_decoding(tmp_path):
    target = make_target("llama", seed=3)
    every_row_transposed = {rows: ("w_xt", max(rows, 2)) for rows in range(1, 5)}
    tune_linear_kernels(target, path=saved_plan(tmp_path, every_row_transposed))
    drafter = OracleMTPDrafter.from_target(target, num_depths=3, draft_vocab_size=48)
    drafter.rng, accepted = random.Random(0), 0
    for seed, (length, new_tokens) in enumerate([(5, 30), (12, 17)]):
        prompt = torch.randint(
            0, target.config.vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(seed)
        )
        reference = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        drafter.reference = reference
        output = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        assert torch.equal(output, reference)
        accepted += sum(drafter.speculation_stats.accepted)
    assert installed_plan(drafter) == installed_plan(target)  # bound, the drafter follows the target's plan
    assert accepted > 10, "the oracle should have made many drafts acceptable"


def test_bad_tuning_arguments_are_refused_before_measuring():
    with pytest.raises(ValueError, match="positive integers"):
        kernels.measure_linear_kernels(make_target("llama"), max_rows=0)
    with pytest.raises(ValueError, match="no nn.Linear"):
        kernels.measure_linear_kernels(nn.Sequential(nn.ReLU()))


def test_processes_starting_together_measure_once(tmp_path, monkeypatch):
    """Two loads of one target at once (threads here, processes in use: the lock is a file beside the cache entry)
    measure the kernel plan and the verify-cost profile once; the second waits for the first and reads its result."""
    import time

    calls = {"plan": 0, "profile": 0}
    measure_plan, profile = kernels.measure_linear_kernels, verify_cost.profile_verify_cost

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            time.sleep(0.3)  # long enough for the other thread to arrive while this one measures
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(kernels, "measure_linear_kernels", counted("plan", measure_plan))
    monkeypatch.setattr(verify_cost, "profile_verify_cost", counted("profile", profile))
    monkeypatch.setenv("ANGELSPEC_CACHE", str(tmp_path))
    targets = [make_target("llama", dtype=torch.float32, seed=11) for _ in range(2)]

    def load(target):
        tune_linear_kernels(target, max_rows=2)
        verify_cost.load_cost_model(target)

    errors = errors_of_concurrent_calls(load, targets)
    assert not errors and calls == {"plan": 1, "profile": 1}
    assert installed_plan(targets[0]).choices == installed_plan(targets[1]).choices

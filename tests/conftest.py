"""Tiny random targets of several architectures, and the real SmolLM2 tokenizer (no weights needed).

The suite is self-contained: prompt sets come from the package's shipped copies and `tests/fixtures/data`, the Hub is
offline with an empty cache, and the guard in `tests/guard` fails any test (or subprocess of one) that reads `../shared`
beside the checkout or reaches another host.
"""

import atexit
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
GUARD_DIR = os.path.join(TESTS_DIR, "guard")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="angelspec-test-hf-home-")  # no Hub cache to fall back on
os.environ["ANGELSPEC_DATA_DIR"] = os.path.join(TESTS_DIR, "fixtures", "data")
# Verify-cost profiles, kernel plans and the converted GGUF target go to a throwaway folder, not the user's cache: one
# for the run, made by the first process (pytest's, or xdist's controller) and shared by the workers it starts, so
# that the real target is converted and measured once per run, not once per worker; removed when that process exits.
if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("ANGELSPEC_TEST_CACHE")):
    os.environ["ANGELSPEC_TEST_CACHE"] = tempfile.mkdtemp(prefix="angelspec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ANGELSPEC_TEST_CACHE"], True)
os.environ["ANGELSPEC_CACHE"] = os.environ["ANGELSPEC_TEST_CACHE"]
os.environ["ANGELSPEC_TEST_FORBIDDEN_DIRS"] = os.path.abspath(os.path.join(TESTS_DIR, "..", "..", "shared"))
os.environ["ANGELSPEC_TEST_GUARD_LOG"] = tempfile.mkstemp(prefix="angelspec-test-guard-", suffix=".log")[1]
if GUARD_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # subprocesses import the guard at start-up
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [GUARD_DIR, os.environ.get("PYTHONPATH")]))
_guard_spec = importlib.util.spec_from_file_location(
    "angelspec_test_guard", os.path.join(GUARD_DIR, "sitecustomize.py")
)
_guard_spec.loader.exec_module(importlib.util.module_from_spec(_guard_spec))  # guards this process

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import angelspec_hf  # noqa: E402,F401  (drafters registered on first lookup)


if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: more threads per worker would only oversubscribe
    torch.set_num_threads(1)
    # and so would a subprocess of a test (the CLI, remote code, an installed wheel) with the machine's threads: its
    # OpenMP threads spin against the other worker's, many times slower than one thread
    os.environ["OMP_NUM_THREADS"] = "1"

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral"]


def make_target(model_type: str = "llama", vocab_size: int = 96, seed: int = 0, dtype=torch.float64, **overrides):
    """A tiny random causal LM of `model_type`, in eval mode, frozen."""
    values = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **values)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval().requires_grad_(False)
    model.config.name_or_path = f"tiny-{model_type}-{seed}"
    # Random weights are nearly flat: sharpen the output so greedy decoding has clear winners, as a real LM does.
    model.lm_head.weight.mul_(8.0)
    return model


class PackageLog:
    """What the package logged (through transformers' logging, under the `angelspec_hf` loggers) in a block."""

    def __init__(self, caplog):
        self.caplog = caplog

    @contextlib.contextmanager
    def _warnings(self, found: list):
        start = len(self.caplog.records)
        with self.caplog.at_level(logging.WARNING, logger="angelspec_hf"):
            yield
        found += [
            record.getMessage()
            for record in self.caplog.records[start:]
            if record.levelno >= logging.WARNING and record.name.startswith("angelspec_hf")
        ]

    @contextlib.contextmanager
    def warns(self, pattern: str):
        """The block logs a warning whose message matches `pattern` (`re.search`)."""
        found = []
        with self._warnings(found):
            yield found
        assert any(re.search(pattern, message) for message in found), f"no warning matching {pattern!r}: {found}"

    @contextlib.contextmanager
    def silent(self):
        """The block logs no warning."""
        found = []
        with self._warnings(found):
            yield
        assert not found, found


def errors_of_concurrent_calls(function, arguments) -> list[Exception]:
    """Call `function(argument)` for every argument at once, each in its own thread; the exceptions they raised."""
    import threading

    errors = []

    def call(argument):
        try:
            function(argument)
        except Exception as error:  # noqa: BLE001  (returned for the test to assert on)
            errors.append(error)

    threads = [threading.Thread(target=call, args=(argument,)) for argument in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.fixture
def package_log(caplog):
    return PackageLog(caplog)


@pytest.fixture(autouse=True)
def isolation_guard():
    """Fail the test when it, or a process it started, touched `../shared` or the network (see tests/guard)."""
    log_path = os.environ["ANGELSPEC_TEST_GUARD_LOG"]
    start = os.path.getsize(log_path)
    yield
    with open(log_path, encoding="utf-8") as log:
        log.seek(start)
        violations = log.read()
    if violations:
        pytest.fail(f"the test left the repository:\n{violations}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (chat template included), as the shipped MTP card carries it (read in a fraction of
    a second; parsing the GGUF file's takes seconds; that the two are one is tested in test_hub.py)."""
    from transformers import AutoTokenizer

    from angelspec_hf.hub import shipped_drafter_path

    return AutoTokenizer.from_pretrained(shipped_drafter_path("smollm2-135m-instruct-mtp"))


@pytest.fixture(scope="session")
def packageless_python():
    """The run's interpreter that cannot import angelspec_hf (`tests/packageless.py`), for the remote-code tests."""
    from packageless import PackagelessInterpreter

    interpreter = PackagelessInterpreter()
    yield interpreter
    interpreter.close()


@pytest.fixture(scope="module")
def chat_target(smollm2_tokenizer):
    """A tiny Llama speaking the SmolLM2 vocabulary, so the real chat template applies."""
    return make_target(
        "llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32, seed=3, eos_token_id=2, pad_token_id=2
    )


@pytest.fixture
def dcut_always_drafts(monkeypatch):
    """D-cut drafts every round (its per-round cut still decides what is verified). Its choice to skip a round
    reads only earlier rounds, so pinning it cannot change the output law; it keeps short test runs, which D-cut's
    own pricing would rarely let draft, exercising the cut."""
    from angelspec_hf.generation.policies import DCut

    monkeypatch.setattr(DCut, "drafting_pays", lambda self, budget, backlog: True)


def rotate_router_members(monkeypatch):
    """A router's member for each request changes every round and differs between neighbouring requests: every
    round splits the batch, so every member drafts, alone and beside the others (the members' states split and
    merged back). Which member drafts reads only the round count, so the output law cannot change. Returns the
    count of planned rounds (a dict, updated as decoding goes)."""
    from angelspec_hf.generation.routing import RoutingPolicy

    rounds = {"count": 0}
    original = RoutingPolicy.plan

    def plan(self, state, *args, **kwargs):
        rounds["count"] += 1
        for r, row in enumerate(state.rows):
            row.forced = (r + rounds["count"]) % len(self.router.members)
        return original(self, state, *args, **kwargs)

    monkeypatch.setattr(RoutingPolicy, "plan", plan)
    monkeypatch.setattr(
        RoutingPolicy, "choice", lambda self, state, r, pending=(): (getattr(state.rows[r], "forced", 0), None, False)
    )
    return rounds


def pytest_collection_modifyitems(items):
    """The χ² tests first (each 5-20 s, the rest mostly under 2 s): pytest-xdist hands tests out in this order, so the
    long ones no longer arrive last and keep one worker busy while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("chi2") is None)


def take_transformers_loop(monkeypatch):
    """Single-sequence `generate(assistant_model=drafter)` calls take transformers' `_assisted_decoding` loop with
    `AngelSpecCandidateGenerator`, as calls with a setting only that loop has do, instead of the engine."""
    from angelspec_hf.generation import speculative

    monkeypatch.setattr(speculative, "runs_on_engine", lambda arguments: arguments["input_ids"].shape[0] > 1)


@pytest.fixture
def on_transformers_loop(monkeypatch):
    take_transformers_loop(monkeypatch)

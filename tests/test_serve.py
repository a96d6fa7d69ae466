"""`angelspec serve` with real clients (openai, httpx) against a server on 127.0.0.1 with a tiny target: greedy
output equal to `generate()`, streaming, seeded sampling, bad requests refused while others complete, disconnects,
a full server, deadlines, many concurrent requests, and a clean stop on SIGTERM."""

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from conftest import make_target

from angelspec_hf import AngelSpecMTPDrafter, SuffixDrafter
from angelspec_hf.serving import background_server, build_app
from angelspec_hf.serving.app import TextAssembler


PROMPTS = ["Write a haiku about the sea.", "What is 12 times 7?", "List three colours.", "Say hello in French."]


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    return make_target(
        "llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32, seed=3, eos_token_id=2, pad_token_id=2
    )


@contextlib.contextmanager
def running_server(target, tokenizer, drafter=None, max_pending=256, slow_step=0.0, **app_options):
    """A server on a free port of 127.0.0.1, in a thread; yields its base URL and its engine loop."""
    app, loop = build_app(
        target, tokenizer, drafter, model_name="tiny", max_batch_size=8, max_pending=max_pending, **app_options
    )
    if slow_step:
        step = loop.engine.step
        loop.engine.step = lambda: (time.sleep(slow_step), step())[1]
    with background_server(app) as url:
        yield url, loop


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def reference(target, tokenizer, prompt: str, max_new_tokens: int, chat: bool = True) -> str:
    """What `target.generate()` writes, greedy."""
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    output = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("drafter_kind", ["none", "mtp", "suffix"])
def test_greedy_output_over_http_equals_generate(target, smollm2_tokenizer, drafter_kind):
    drafter = {
        "none": lambda: None,
        "mtp": lambda: AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=2),
        "suffix": lambda: SuffixDrafter.from_target(target, smollm2_tokenizer),
    }[drafter_kind]()
    with running_server(target, smollm2_tokenizer, drafter) as (url, _):
        api = client(url)

        async def every_prompt():  # concurrently: the requests share the engine's batch
            async_api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            chats = [
                async_api.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": p}], max_tokens=20, temperature=0
                )
                for p in PROMPTS
            ]
            plain = [
                async_api.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0) for p in PROMPTS
            ]
            return await asyncio.gather(*chats, *plain)

        answers = asyncio.run(every_prompt())
        for prompt, answer in zip(PROMPTS, answers[: len(PROMPTS)]):
            assert answer.choices[0].message.content == reference(target, smollm2_tokenizer, prompt, 20)
            assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens <= 20
            assert answer.object == "chat.completion" and answer.model == "tiny"
        for prompt, answer in zip(PROMPTS, answers[len(PROMPTS) :]):
            assert answer.choices[0].text == reference(target, smollm2_tokenizer, prompt, 12, chat=False)
        # Streamed: the pieces add up to the same text, the last chunk says why it ended.
        stream = api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=20, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == answers[0].choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in (
            "stop",
            "length",
        )
        assert [model.id for model in api.models.list()] == ["tiny"]
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_seeded_sampling_is_reproducible_and_stop_strings_end_the_text(target, smollm2_tokenizer):
    with running_server(target, smollm2_tokenizer, SuffixDrafter.from_target(target, smollm2_tokenizer)) as (url, _):
        api = client(url)

        def sample(seed):
            return (
                api.completions.create(
                    model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=1.0, top_p=0.9, seed=seed
                )
                .choices[0]
                .text
            )

        first = sample(5)
        assert sample(5) == first and len({first, sample(6), sample(7)}) > 1
        whole = api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0).choices[0].text
        stop = whole[5:8]
        cut = api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop])
        assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
        streamed = api.completions.create(
            model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed) == cut.choices[0].text


def test_bad_requests_are_refused_by_field_while_others_complete(target, smollm2_tokenizer):
    with running_server(target, smollm2_tokenizer) as (url, _):
        good = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        bad = [
            ({**good, "temperature": -1}, 400, "temperature"),
            ({**good, "top_p": 0}, 400, "top_p"),
            ({**good, "n": 2}, 400, "n"),
            ({**good, "messages": []}, 400, "messages"),
            ({**good, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
            ({**good, "max_tokens": 0}, 400, "max_tokens"),
            ({**good, "max_tokens": 100_000}, 400, "max_tokens"),
            ({**good, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
            ({**good, "logprobs": True}, 400, "logprobs"),
            ({**good, "tools": [{"type": "function"}]}, 400, "tools"),
            ({**good, "model": "gpt-9"}, 404, "model"),
        ]

        async def mixed():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                calls = [http.post("/v1/chat/completions", json=body) for body, _, _ in bad]
                calls += [http.post("/v1/chat/completions", json=good) for _ in range(4)]
                calls.append(
                    http.post(
                        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
                    )
                )
                return await asyncio.gather(*calls)

        responses = asyncio.run(mixed())
        for (_, status, param), response in zip(bad, responses):
            assert response.status_code == status, (param, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"], response.text
        expected = reference(target, smollm2_tokenizer, "Hi", 8)
        for response in responses[len(bad) : len(bad) + 4]:
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == expected
        assert responses[-1].status_code == 400 and "not valid JSON" in responses[-1].json()["error"]["message"]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'angelspec_requests_total{endpoint="chat",outcome="invalid"} 12.0' in metrics
        assert 'angelspec_requests_total{endpoint="chat",outcome="ok"} 4.0' in metrics
        # Without max_tokens a request gets the server's default, within the context.
        long_prompt = {**good, "messages": [{"role": "user", "content": "word " * 480}]}
        del long_prompt["max_tokens"]
        answer = httpx.post(f"{url}/v1/chat/completions", json=long_prompt, timeout=60).json()
        assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= 512


def test_a_client_that_disconnects_mid_stream_frees_its_row(target, smollm2_tokenizer):
    with running_server(target, smollm2_tokenizer, slow_step=0.02) as (url, loop):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the stream began; then the client goes away
        deadline = time.monotonic() + 10
        while loop.pending or loop.engine.rows:
            assert time.monotonic() < deadline, "the disconnected request still holds its row"
            time.sleep(0.05)
        assert "disconnected" in httpx.get(f"{url}/metrics").text
        answer = client(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert answer.choices[0].text == reference(target, smollm2_tokenizer, PROMPTS[1], 6, chat=False)


def test_a_full_server_answers_429_and_a_late_request_times_out(target, smollm2_tokenizer):
    with running_server(target, smollm2_tokenizer, max_pending=1, slow_step=0.05, request_timeout=1.0) as (url, _):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0}

        async def two():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                first = asyncio.create_task(http.post("/v1/completions", json=body))
                await asyncio.sleep(0.3)
                second = await http.post("/v1/completions", json=body)
                return await first, second

        first, second = asyncio.run(two())
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert "--max-pending 1" in second.json()["error"]["message"]
        assert first.status_code == 504 and "--request-timeout" in first.json()["error"]["message"]


def test_two_hundred_concurrent_requests_are_all_answered(target, smollm2_tokenizer):
    with running_server(target, smollm2_tokenizer, SuffixDrafter.from_target(target, smollm2_tokenizer)) as (
        url,
        loop,
    ):

        async def many():
            async_api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            return await asyncio.gather(
                *[
                    async_api.completions.create(model="tiny", prompt=PROMPTS[i % 4], max_tokens=4, temperature=0)
                    for i in range(200)
                ]
            )

        answers = asyncio.run(many())
        expected = [reference(target, smollm2_tokenizer, prompt, 4, chat=False) for prompt in PROMPTS]
        assert [answer.choices[0].text for answer in answers] == [expected[i % 4] for i in range(200)]
        assert loop.pending == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert 'angelspec_requests_total{endpoint="completions",outcome="ok"} 200.0' in metrics
        for name in ("angelspec_time_to_first_token_seconds_count 200.0", "angelspec_verified_depth_count"):
            assert name in metrics


def test_text_is_released_whole_characters_and_never_a_stop_strings_start(smollm2_tokenizer):
    ids = smollm2_tokenizer("héllo wörld, stop here", add_special_tokens=False)["input_ids"]
    assembler = TextAssembler(smollm2_tokenizer, ["stop"])
    pieces = [assembler.add([token]) for token in ids]
    assert "".join(pieces) == "héllo wörld, " and assembler.stopped
    assert all("\ufffd" not in piece for piece in pieces)
    plain = TextAssembler(smollm2_tokenizer, [])
    assert "".join(plain.add([token]) for token in ids) + plain.add([], final=True) == "héllo wörld, stop here"


def test_serve_stops_cleanly_on_sigterm(target, smollm2_tokenizer, tmp_path):
    """The command itself: it loads a target folder, serves, and on SIGTERM lets the live request finish."""
    target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "angelspec_hf.cli", "serve", "--target", str(tmp_path / "target")]
    server = subprocess.Popen(
        [*command, "--port", str(port), "--linear-kernels", "default", "--served-model-name", "tiny"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 64, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
        # uvicorn re-raises the signal once it has shut down, so the exit status is SIGTERM's, after a clean stop.
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
        log = server.stdout.read()
        assert "Application shutdown complete" in log and "Traceback" not in log, log
    finally:
        if server.poll() is None:
            server.kill()


def test_the_load_benchmark_compares_each_drafter_with_the_server_without_one(target, smollm2_tokenizer, tmp_path):
    from angelspec_hf.benchmark.load_bench import format_load_table, poisson_arrivals, run_load, write_load_plot

    methods = [("no-drafter", None), ("suffix", SuffixDrafter.from_target(target, smollm2_tokenizer))]
    prompts = PROMPTS + PROMPTS[:2]
    report = run_load(target, smollm2_tokenizer, methods, prompts, [("streams", 2), ("rate", 20.0)], 6, 4)
    assert [(load["kind"], load["level"]) for load in report["loads"]] == [("streams", 2), ("rate", 20.0)]
    for load in report["loads"]:
        baseline, suffix = load["runs"]
        assert baseline["answered"] == suffix["answered"] == len(prompts) and not suffix["failed"]
        assert suffix["identical"] == len(prompts) and baseline["identical"] is None
        assert baseline["speedup"] == 1.0 and suffix["tokens_per_s"] > 0 and suffix["tau"] >= 1.0
        assert 0 < suffix["ttft_p50"] <= suffix["latency_p50"] <= suffix["latency_p90"]
    assert "| 2 streams | suffix | 6/6 |" in format_load_table(report)
    write_load_plot(report, tmp_path / "load.png")
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"
    arrivals = poisson_arrivals(2.0, 2000, seed=1)
    assert arrivals == sorted(arrivals) and abs(len(arrivals) / arrivals[-1] - 2.0) < 0.2


def test_a_thousand_requests_five_percent_malformed_with_flat_memory(target, smollm2_tokenizer):
    """Every good request answered and equal to generate(), every bad one a 4xx naming its field, and the process'
    resident memory no higher after the last hundred requests than after the first (within 20 MiB)."""
    from angelspec_hf.generation.engine import resident_memory_bytes

    drafter = AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=2)
    expected = [reference(target, smollm2_tokenizer, prompt, 5, chat=False) for prompt in PROMPTS]
    rng = random.Random(0)
    bad_fields = [("temperature", -2), ("max_tokens", 0), ("top_p", 5), ("n", 3), ("stop", ["", "x"])]
    plan = [rng.random() < 0.05 for _ in range(1000)]
    with running_server(target, smollm2_tokenizer, drafter) as (url, loop):

        async def send(http, index, gate):
            body = {"model": "tiny", "prompt": PROMPTS[index % 4], "max_tokens": 5, "temperature": 0}
            if plan[index]:
                field, value = bad_fields[index % len(bad_fields)]
                body[field] = value
            async with gate:
                return await http.post("/v1/completions", json=body)

        async def hundreds():
            memory, responses = [], []
            gate = asyncio.Semaphore(32)
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                for start in range(0, 1000, 100):
                    responses += await asyncio.gather(*(send(http, i, gate) for i in range(start, start + 100)))
                    memory.append(resident_memory_bytes(torch.device("cpu")))
            return memory, responses

        memory, responses = asyncio.run(hundreds())
        assert loop.pending == 0  # each request is counted out before its answer is sent
    for index, response in enumerate(responses):
        if plan[index]:
            field = bad_fields[index % len(bad_fields)][0]
            assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
        else:
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected[index % 4]
    assert sum(plan) > 20
    assert memory[-1] - memory[0] < 20 * 2**20, [m // 2**20 for m in memory]

"""What `trace.py`, `rounds.py` and `after_chat.py` share: their command line and a run set up as the suite runs a drafter (the real
target, the shipped card under D-cut, greedy, the prompts chat-encoded), warmed up on the first prompt."""

import argparse

import torch

import angelspec_hf
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.policies import resolve_policy
from angelspec_hf.hub import load_drafter
from angelspec_hf.prompts import encode_chat


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("drafter", help="a shipped card's short name: mtp, dfly, dflash, suffix, router")
    parser.add_argument("prompts", help="a suite domain or a prompt set name")
    parser.add_argument("limit", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--data-dir", default="../shared/data")
    return parser


def dcut_drafter(short: str, model, tokenizer):
    """The shipped card `smollm2-135m-instruct-<short>` on the target, under D-cut."""
    drafter = load_drafter(f"smollm2-135m-instruct-{short}", model, tokenizer)
    for key, value in resolve_policy("dcut", drafter).generation_settings().items():
        setattr(drafter.generation_config, key, value)
    return drafter


def warm_up(model, drafter, input_ids: torch.Tensor) -> None:
    """A few tokens of plain and of speculative decoding, so that neither pays its first call's set-up."""
    model.generate(input_ids, max_new_tokens=4, do_sample=False)
    model.generate(input_ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)


def dcut_run(args):
    """(target model, drafter under D-cut, encoded prompts, greedy stopping settings), warmed up."""
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    prompts = domain_or_set_prompts(args.prompts, args.limit, args.data_dir)
    drafter = dcut_drafter(args.drafter, model, tokenizer)
    stop = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": 0, "do_sample": False}
    encoded = [torch.tensor([encode_chat(tokenizer, prompt)]) for prompt in prompts]
    warm_up(model, drafter, encoded[0])
    return model, drafter, encoded, stop

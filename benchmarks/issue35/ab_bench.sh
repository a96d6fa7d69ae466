# Sourced by the A/B scripts beside it (run from the repository root): `ab_bench old|new OUTPUT_STEM BENCH_ARGS...`
# runs `angelspec bench BENCH_ARGS` with the old code (the git worktree at /tmp/wt_old, which the script adds) or the
# checkout, each with its own measurement cache, writing OUTPUT_STEM.json and OUTPUT_STEM.log.
ab_bench() {
  local code=$1 stem=$2 path=. cache=/tmp/cache_ab_new
  shift 2
  if [ "$code" = old ]; then path=/tmp/wt_old; cache=/tmp/cache_ab_old; fi
  ANGELSPEC_CACHE=$cache PYTHONPATH=$path .venv/bin/python -m angelspec_hf.cli bench "$@" \
    --output "$stem.json" > "$stem.log" 2>&1
}

# Sourced by the A/B scripts beside it (run from the repository root): `ab_bench old|new OUTPUT_STEM BENCH_ARGS...`
# runs `angelspec bench BENCH_ARGS` with the old code (the git worktree at /tmp/wt_old, see `ab_old_code`) or the
# checkout, each with its own measurement cache, writing OUTPUT_STEM.json and OUTPUT_STEM.log.

# `ab_old_code REV`: the old code is REV, in the git worktree at /tmp/wt_old (added, or moved to REV when an earlier
# A/B left it at another commit).
ab_old_code() {
  if [ -d /tmp/wt_old ]; then
    git -C /tmp/wt_old checkout --quiet --detach "$1"
  else
    git worktree add --detach /tmp/wt_old "$1"
  fi
}

ab_bench() {
  local code=$1 stem=$2 path=. cache=/tmp/cache_ab_new
  shift 2
  if [ "$code" = old ]; then path=/tmp/wt_old; cache=/tmp/cache_ab_old; fi
  # -P: `python -m` puts the working directory (the checkout) first on sys.path, ahead of PYTHONPATH, so without it
  # the old side ran the new code (found 2026-12-07: the A/Bs made with this file before then compared new with new)
  ANGELSPEC_CACHE=$cache PYTHONPATH=$path .venv/bin/python -P -m angelspec_hf.cli bench "$@" \
    --output "$stem.json" > "$stem.log" 2>&1
}

# `ab_pairs OUTPUT_DIR "PROMPT_SETS" BENCH_ARGS...`: for each prompt set, the old and the new code back to back, the
# old first on the first set and the order swapped from one set to the next, writing OUTPUT_DIR/SET_old and _new
# (a `spec_bench:category` set named by its category).
ab_pairs() {
  local out=$1 sets=$2 first=old prompts code order
  shift 2
  for prompts in $sets; do
    order="old new"; [ $first = new ] && order="new old"
    for code in $order; do
      ab_bench $code "$out/${prompts#*:}_$code" --prompts $prompts "$@"
    done
    [ $first = old ] && first=new || first=old
  done
}

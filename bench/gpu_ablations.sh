#!/usr/bin/env bash
# The drafter-quality ablations on one GPU host without internet, in commands cut after ~10 minutes
# (bench/RESULTS.md, "ablations"). A base run at 4,000 conversations -- the GPU profile's recipe at
# TTT 3 x 5 epochs on two parts, the first 1,000 and the next 3,000 conversations -- then one DVC
# experiment per ablation, queued and run side by side by DVC's own queue (tools/offline_gpu
# enqueue / queue). The whole data's point (TTT 3 x 5, all 17,333 conversations) is the fourth run's.
#
#   [JOBS=3] [ABLATIONS="vocab8k bf16"] bench/gpu_ablations.sh SECONDS
#       SECONDS: what is left of this command (needs tools/offline_gpu's install first); ABLATIONS: which
#       of k1 offpolicy vocab8k vocab32k bf16 (default: all)
#
# JOBS experiments at once share the one GPU: at 5, one process holding 117 GB (most likely an
# evaluate's cached blocks: eaglenest/evaluate.py now grows its segments instead) left
# two of them out of memory; since, 2 at once ran clean (bench/RESULTS.md, "Ablations, second
# base"). A failed one is queued again by the next command.
#
# Safe to run again: setup keeps the work repo, finished stages are skipped, queued experiments are
# not queued twice, and `queue` waits for the ones still running. Results: $OUT/ablations.tar.gz.
set -euo pipefail
W=${WORKDIR:-$HOME/abl}
OUTDIR=$HOME/ablation_results   # tarred into ${OUT:-bench/out}/ablations.tar.gz: a command returns at most 8 files
G=(python3 -m tools.offline_gpu --workdir "$W")
end=$((SECONDS + ${1:-560}))
left() { echo $((end - SECONDS)); }

"${G[@]}" setup -S train.epochs=5 -S evaluate.speed_questions=1 -S evaluate.min_tau=null \
  -S 'data.parts=[sharegpt-k1, sharegpt-k3]' \
  -S 'data.sharegpt={sharegpt-k1: {start: 0, count: 1000, turns: 2}, sharegpt-k3: {start: 1000, count: 3000, turns: 2}}'
rc=0  # run: 0 all done, 3 unfinished (the next command goes on), else failed
"${G[@]}" run --budget "$(left)" --min-left 20 | tee /tmp/ablation_base.log || rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || exit "$rc"
# experiments start from the committed base: none is queued before every base stage is done
grep -q "all stages done" /tmp/ablation_base.log || { echo "base not finished; run again"; exit 0; }

declare -A SETS=(
  [k1]='data.parts=[sharegpt-k1]'         # data size: 1,000 conversations
  [offpolicy]='generate.enabled=false'    # ShareGPT's own answers, not the target's
  [vocab8k]='pack.draft_vocab_size=8192'
  [vocab32k]='pack.draft_vocab_size=32768'
  [bf16]='store.states=bf16'              # bf16 states (the profile stores fp8)
)
for name in ${ABLATIONS:-k1 offpolicy vocab8k vocab32k bf16}; do
  [ -n "${SETS[$name]:-}" ] || { echo "unknown ablation $name (known: ${!SETS[*]})"; exit 2; }
  "${G[@]}" enqueue "$name" -S "${SETS[$name]}"
done
# DVC's queue workers may not outlive a command: start them only with the time for most of the work
[ "$(left)" -gt 300 ] || { echo "queued; run again to run them"; exit 0; }
"${G[@]}" queue --jobs "${JOBS:-3}" --budget $(($(left) - 40))

mkdir -p "$OUTDIR"
"${G[@]}" report --out "$OUTDIR" >/dev/null
(cd "$W" && dvc exp show --md --no-pager -A --only-changed >"$OUTDIR/exp_show.md" 2>&1 || true)
cp "$W"/.offline_gpu/{queued,experiments,failed}.json "$OUTDIR/" 2>/dev/null || true
rm -rf "$OUTDIR/drafter"   # the base's drafter (~45 MB): not needed to compare runs
mkdir -p "${OUT:-bench/out}"
tar czf "${OUT:-bench/out}/ablations.tar.gz" -C "$OUTDIR" .
echo "ablations: results in ${OUT:-bench/out}/ablations.tar.gz"

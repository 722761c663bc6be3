#!/usr/bin/env bash
# The drafter family at equal compute on the SmolLM2 testbed (one GPU): DFlash, DFlash 2 and DSpark
# trained on the same answers for the same steps, each run's wall time recorded; from scratch, and
# fine-tuned from the bundled DFlash drafter (upgraded: DFlash 2's convolutions start as the
# identity, its selector fresh; DSpark's Markov and confidence heads fresh). Then every drafter
# trained, and the bundled one, in one `dflashkit eval` run (greedy; T 0.7 with both rules).
#
#   benchmarks/family_equal_compute.sh STAGE...     stages: data scratch timed finetune greedy sampled
#
# `timed` trains DFlash for the wall time each DFlash 2 run took, from scratch and fine-tuned (equal GPU
# time: the schedule is fitted to the steps that fit, `train.time_budget_s`).
#
# WORK (default runs/family) holds the data, the runs and the reports; STEPS (default 600)
# the optimiser steps of every run; PROMPTS (default self:12000) the prompts the target answers;
# LIMIT (default: every prompt) the prompts per evaluation suite; KINDS (default: dflash dflash2 dspark)
# the drafter kinds that `scratch` and `finetune` train. An evaluation cut short resumes
# by suite when run again.
set -euo pipefail
WORK=${WORK:-runs/family}
STEPS=${STEPS:-600}
PROMPTS=${PROMPTS:-self:12000}
KINDS=${KINDS:-dflash dflash2 dspark}
BUNDLED=src/dflashkit/assets/smollm2-drafter
CFG=configs/smollm2-general.yaml
GPU=(target.device=cuda target.dtype=bfloat16)
dflashkit() { python3 -m dflashkit.cli "$@"; }

train() {  # NAME, then overrides
  local name=$1; shift
  local t0=$SECONDS
  dflashkit train --auto-resume --config "$CFG" "${GPU[@]}" train.output_dir="$WORK/$name" data.tokenized="$WORK/data/tokenized.jsonl" \
      train.max_steps="$STEPS" train.eval_every=$((STEPS / 2)) train.eval_samples=48 "$@"
  local steps; steps=$(tail -n 1 "$WORK/$name/metrics.jsonl" | python3 -c "import json, sys; print(json.load(sys.stdin).get('step'))")
  echo "{\"run\": \"$name\", \"steps\": $steps, \"wall_s\": $((SECONDS - t0))}" >> "$WORK/wall.jsonl"
}

wall_of() {  # the wall time of run NAME (the longest recorded: a finished run run again records seconds)
  python3 -c "import json, sys; print(max(r['wall_s'] for r in map(json.loads, open(sys.argv[1])) if r['run'] == sys.argv[2]))" \
      "$WORK/wall.jsonl" "$1"
}

for stage in "$@"; do
  case $stage in
    data)
      python3 benchmarks/quality_run.py --config "$CFG" --budget-s 300 --data-only train.output_dir="$WORK/data" \
          data.prompts="$PROMPTS" "${GPU[@]}" ;;
    scratch)
      for kind in $KINDS; do train "$kind" train.lr=6e-4 drafter.kind="$kind"; done ;;
    timed)  # for each DFlash 2 run recorded, DFlash for its wall time
      grep -q '"run": "dflash2"' "$WORK/wall.jsonl" &&
        train dflash_t train.lr=6e-4 train.max_steps=$((STEPS * 10)) train.time_budget_s="$(wall_of dflash2)"
      grep -q '"run": "dflash2_ft"' "$WORK/wall.jsonl" &&
        train dflash_ft_t train.lr=2e-4 drafter.init_from=$BUNDLED train.max_steps=$((STEPS * 10)) \
            train.time_budget_s="$(wall_of dflash2_ft)"
      true ;;
    finetune)
      for kind in $KINDS; do train "${kind}_ft" train.lr=2e-4 drafter.init_from=$BUNDLED drafter.kind="$kind"; done ;;
    greedy|sampled)
      drafters=(--drafter bundled="$BUNDLED")  # every run trained so far
      for run in dflash dflash_t dflash2 dspark dflash_ft dflash_ft_t dflash2_ft dspark_ft; do
        [ -d "$WORK/$run/best" ] && drafters+=(--drafter "$run=$WORK/$run/best")
      done
      extra=(); [ "$stage" = sampled ] && extra=(--temperature 0.7 --acceptance match,rejection)
      [ -n "${LIMIT:-}" ] && extra+=(--limit "$LIMIT")
      dflashkit eval "${drafters[@]}" --budgets 64 "${extra[@]}" --resume --out "$WORK/eval-$stage" "${GPU[@]}" ;;
    *) echo "unknown stage '$stage' (data scratch timed finetune greedy sampled)" >&2; exit 2 ;;
  esac
done

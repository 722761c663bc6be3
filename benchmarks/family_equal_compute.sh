#!/usr/bin/env bash
# DFlash against DFlash 2 at equal compute on the SmolLM2 testbed (one GPU): the same answers, the
# same steps, each drafter's wall time recorded; from scratch, and fine-tuned from the bundled
# DFlash drafter (DFlash 2 upgraded: its convolutions start as the identity, its selector fresh).
# Then every drafter in one `dflashkit eval` run (greedy; T 0.7 with both acceptance rules).
#
#   benchmarks/family_equal_compute.sh STAGE...     stages: data scratch finetune greedy sampled
#
# WORK (default runs/family) holds the data, the four runs and the reports; STEPS (default 600)
# the optimiser steps of every run; PROMPTS (default self:12000) the prompts the target answers.
set -euo pipefail
WORK=${WORK:-runs/family}
STEPS=${STEPS:-600}
PROMPTS=${PROMPTS:-self:12000}
BUNDLED=src/dflashkit/assets/smollm2-drafter
CFG=configs/smollm2-general.yaml
GPU=(target.device=cuda target.dtype=bfloat16)
dflashkit() { python3 -m dflashkit.cli "$@"; }

train() {  # NAME, then overrides
  local name=$1; shift
  local t0=$SECONDS
  dflashkit train --auto-resume --config "$CFG" "${GPU[@]}" train.output_dir="$WORK/$name" data.tokenized="$WORK/data/tokenized.jsonl" \
      train.max_steps="$STEPS" train.eval_every=$((STEPS / 2)) train.eval_samples=48 "$@"
  echo "{\"run\": \"$name\", \"steps\": $STEPS, \"wall_s\": $((SECONDS - t0))}" >> "$WORK/wall.jsonl"
}

for stage in "$@"; do
  case $stage in
    data)
      python3 benchmarks/quality_run.py --config "$CFG" --budget-s 300 --data-only train.output_dir="$WORK/data" \
          data.prompts="$PROMPTS" "${GPU[@]}" ;;
    scratch)
      train dflash train.lr=6e-4
      train dflash2 train.lr=6e-4 drafter.kind=dflash2 ;;
    finetune)
      train dflash_ft train.lr=2e-4 drafter.init_from=$BUNDLED
      train dflash2_ft train.lr=2e-4 drafter.init_from=$BUNDLED drafter.kind=dflash2 ;;
    greedy|sampled)
      drafters=(--drafter dflash="$WORK/dflash/best" --drafter dflash2="$WORK/dflash2/best"
                --drafter dflash_ft="$WORK/dflash_ft/best" --drafter dflash2_ft="$WORK/dflash2_ft/best")
      extra=(); [ "$stage" = sampled ] && extra=(--temperature 0.7 --acceptance match,rejection)
      dflashkit eval "${drafters[@]}" --budgets 64 "${extra[@]}" --out "$WORK/eval-$stage" "${GPU[@]}" ;;
    *) echo "unknown stage '$stage' (data scratch finetune greedy sampled)" >&2; exit 2 ;;
  esac
done

#!/bin/bash
# Train and extract probes of docs/reliability.md (rows T3-T8, E1, E2); needs the set-up there (/tmp/p/model).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=src OMP_NUM_THREADS=1
D="python3 -m dflashkit.cli"
M=/tmp/p/model; W=/tmp/p/w; rm -rf $W; mkdir -p $W
python3 - <<'PY'
import json, torch
g = torch.Generator().manual_seed(0)
with open("/tmp/p/w/tok.jsonl", "w") as f:
    for i in range(12):
        f.write(json.dumps({"id": str(i), "input_ids": torch.randint(20, 40000, (40,), generator=g).tolist(), "loss_mask": [0]*8 + [1]*32}) + "\n")
PY
T="target.path=$M data.tokenized=$W/tok.jsonl train.batch_size=2 train.anchors_per_seq=8 train.eval_samples=2 train.eval_every=1 train.tensorboard=false drafter.num_layers=1 drafter.num_taps=2 target.device=cpu"
echo "== fresh run"; $D train $T train.output_dir=$W/run train.max_steps=2 2>&1 | tail -1; echo "rc=$?"
echo "== same dir again, no --resume"; $D train $T train.output_dir=$W/run train.max_steps=2 2>&1 | tail -1
echo "== --overwrite"; $D train --overwrite $T train.output_dir=$W/run train.max_steps=2 2>&1 | tail -1
echo "== two runs at once"; $D train $T train.output_dir=$W/two train.max_steps=400 > $W/a.log 2>&1 & A=$!
while [ ! -f $W/two/.lock ]; do sleep 0.2; done; sleep 1
$D train --resume $T train.output_dir=$W/two train.max_steps=400 2>&1 | tail -1; kill $A; wait $A 2>/dev/null
echo "== lr=1e30"; $D train $T train.output_dir=$W/nan train.max_steps=4 train.lr=1e30 2>&1 | tail -1; ls $W/nan
echo "== mask token 2 (EOS)"; $D train $T train.output_dir=$W/mask train.max_steps=2 drafter.mask_token_id=2 2>&1 | tail -1
echo "== max_steps=true"; $D train $T train.output_dir=$W/x train.max_steps=true 2>&1 | tail -1
echo "== extract, then the same ids/lengths re-tokenized"; $D extract --input $W/tok.jsonl --out $W/feat target.path=$M drafter.num_taps=2 2>&1 | tail -1
python3 -c "
import json; rows=[json.loads(l) for l in open('$W/tok.jsonl')]
open('$W/tok2.jsonl','w').writelines(json.dumps({**r,'input_ids':[t+1 for t in r['input_ids']]})+'\n' for r in rows)"
$D extract --input $W/tok2.jsonl --out $W/feat target.path=$M drafter.num_taps=2 2>&1 | tail -1
echo "== kill between a shard's temp write and its rename, then resume"
DFLASHKIT_KILL_AT="replace shard-00000.json" $D extract --input $W/tok.jsonl --out $W/feat3 target.path=$M drafter.num_taps=2 --shard-size 100 > /dev/null 2>&1; echo "rc=$? left: $(ls -A $W/feat3 | tr '\n' ' ')"
$D extract --input $W/tok.jsonl --out $W/feat3 target.path=$M drafter.num_taps=2 --shard-size 100 2>&1 | tail -1; echo "after resume: $(ls -A $W/feat3 | grep '^\.' | wc -l) dot-files; modes: $(stat -c %a $W/feat3/* | sort -u | tr '\n' ' ')"

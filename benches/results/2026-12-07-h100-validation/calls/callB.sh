# call 3: the compact-state moments reusing their device tensors (autotune-spares, 409f208)
# against main: the GPU tests of the compact update, then llama-3.1-8b's compact plan regime at
# micro-batches 1-4, the builds alternating, the pool's marks traced.
set -u; bash .gpu/xz-common/unpack.sh; mkdir -p /tmp/r/spares; source .gpu/gpu-env.sh .gpu
timeout 120 .gpu/it-spares compact_state:: --nocapture --test-threads=1 > /tmp/r/spares/tests.txt 2>&1; echo "tests exit $?" >> /tmp/r/spares/tests.txt
grep -E "^test |test result|exit" /tmp/r/spares/tests.txt | tail -8
tar czf $OUT/r.tgz -C /tmp r
for round in ${ROUNDS:-1}; do for mb in 1 2 3 4; do for b in autotune-main autotune-spares; do
  RUST_LOG=autotune=trace timeout 100 .gpu/$b probe --model llama-3.1-8b --precision bf16 \
    --checkpointing all --update in-backward --moments int8 --masters bf16-sr --moments-on host \
    --micro-batch $mb --warmup 1 --steps 3 --gpu-capacity 24564MiB --device cuda --json \
    2> /tmp/r/spares/$b-mb$mb-r$round.log | grep '^{' | sed "s/^{/{\"build\":\"$b\",\"round\":$round,/" >> /tmp/r/spares/probes.jsonl
  xz -f /tmp/r/spares/$b-mb$mb-r$round.log
done; done; tar czf $OUT/r.tgz -C /tmp r; done
python3 - <<'P'
import json
for l in open('/tmp/r/spares/probes.jsonl'):
    r=json.loads(l); print(r['build'], r['round'], r['micro_batch'], r.get('outcome'), round(r.get('tokens_per_s') or 0), round((r.get('peak_gpu_bytes') or 0)/2**30,3))
P
# The tuned plans with 32 sequences per optimizer step (main's build).
mkdir -p /tmp/r/tune-gb32
for m in gpt-1.3b llama-3.2-1b; do
  s0=$SECONDS; timeout 150 .gpu/autotune-main tune --model $m --target rtx4090-32g --global-batch 32 \
    --out /tmp/r/tune-gb32/$m.plan.json --record /tmp/r/tune-gb32/$m.profile.json -v > /tmp/r/tune-gb32/$m.stdout 2> /tmp/r/tune-gb32/$m.log; echo "exit $? $((SECONDS - s0)) s" > /tmp/r/tune-gb32/$m.time
  tar czf $OUT/r.tgz -C /tmp r
  grep -E "^\[|plan|Chosen|verif" /tmp/r/tune-gb32/$m.log | tail -4
done

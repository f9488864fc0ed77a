# call C (H100): where the step's time goes now (gpt-1.3b mb 4, llama-3.2-1b mb 3, ours and
# PyTorch eager, as the 2026-12-06 breakdown), then gpt-1.3b for 32 sequences a step with the
# search that rules out accumulated plans before verifying them (506bea0).
set -u; bash .gpu/xz-common/unpack.sh; mkdir -p /tmp/r; nvidia-smi -L > /tmp/r/smi.txt 2>&1
cp .gpu/autotune-main .gpu/autotune
for row in "gpt-1.3b 4" "llama-3.2-1b 3"; do set -- $row
  STAGES="ours torch" NCU_WARM=1 timeout 235 benches/gpu/breakdown.sh /tmp/r/breakdown $1 bf16 $2 2 torch > /tmp/r/breakdown-$1.log 2>&1
  echo "$1 exit $?"; tar czf $OUT/r.tgz -C /tmp r
done
grep -h "^| " /tmp/r/breakdown/breakdown-*-b?.md | head -30
mkdir -p /tmp/r/tune-gb32; s0=$SECONDS
timeout 150 .gpu/autotune-acc tune --model gpt-1.3b --target rtx4090-32g --global-batch 32 --edge-trials 0 \
  --out /tmp/r/tune-gb32/gpt-1.3b.plan.json --record /tmp/r/tune-gb32/gpt-1.3b.profile.json -v > /tmp/r/tune-gb32/gpt-1.3b.stdout 2> /tmp/r/tune-gb32/gpt-1.3b.log
echo "exit $? $((SECONDS - s0)) s" > /tmp/r/tune-gb32/gpt-1.3b.time; cat /tmp/r/tune-gb32/gpt-1.3b.time
tar czf $OUT/r.tgz -C /tmp r; grep -E "^\[|ruled|not verified" /tmp/r/tune-gb32/gpt-1.3b.log | tail -6

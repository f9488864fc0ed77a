# call B: main's CUDA tests at 75c4deb (the cuBLASLt workspace outside the pool, the worker pool's
# and the compact update's GPU tests), then gpt-1.3b's tune (tune seconds, workers started), then
# the gpt-1.3b tune with 32 sequences per step (the edge trials' time bound).
set -u; bash .gpu/xz-common/unpack.sh; mkdir -p /tmp/r; ls -la .gpu > /tmp/r/ls.txt; nvidia-smi > /tmp/r/smi.txt 2>&1
STAGES=tests TEST_BIN=.gpu/it-main timeout 240 benches/gpu/builds_bench.sh /tmp/r/tests-main autotune-main > /tmp/r/tests-main.log 2>&1
grep -hE "^test result|tests exit|panicked|FAILED" /tmp/r/tests-main/tests.txt | head -12
tar czf $OUT/r.tgz -C /tmp r
cp .gpu/autotune-main .gpu/autotune && TUNE_TIMEOUT=200 timeout 230 benches/gpu/bigmodel_bench.sh /tmp/r/tune tune > /tmp/r/tune.log 2>&1
tar czf $OUT/r.tgz -C /tmp r; cat /tmp/r/tune/tune.time 2>/dev/null; grep -E "workers started|chosen|plan:" /tmp/r/tune/tune.log | tail -4
mkdir -p /tmp/r/tune-gb32; s0=$SECONDS
timeout 200 .gpu/autotune-main tune --model gpt-1.3b --target rtx4090-32g --global-batch 32 \
  --out /tmp/r/tune-gb32/gpt-1.3b.plan.json --record /tmp/r/tune-gb32/gpt-1.3b.profile.json -v > /tmp/r/tune-gb32/gpt-1.3b.stdout 2> /tmp/r/tune-gb32/gpt-1.3b.log
echo "exit $? $((SECONDS - s0)) s" > /tmp/r/tune-gb32/gpt-1.3b.time; cat /tmp/r/tune-gb32/gpt-1.3b.time
tar czf $OUT/r.tgz -C /tmp r; grep -E "^\[" /tmp/r/tune-gb32/gpt-1.3b.log | tail -3

# call A: main's CUDA tests (58ecaba..f637aee) and the h128 one-sweep build's attention tests;
# main against the h128 build on gpt-1.3b (probes alternating, 20 training steps each); main at
# mb 4 × 8 accumulated; fp8 against bf16 with main's build.
set -u; bash .gpu/xz-common/unpack.sh; mkdir -p /tmp/r; ls -la .gpu > /tmp/r/ls.txt
STAGES=tests TEST_BIN=.gpu/it-main timeout 200 benches/gpu/builds_bench.sh /tmp/r/tests-main autotune-main > /tmp/r/tests-main.log 2>&1
STAGES=tests TEST_BIN=.gpu/it-h128 TESTS=cuda_attention:: timeout 120 benches/gpu/builds_bench.sh /tmp/r/tests-h128 autotune-h128 > /tmp/r/tests-h128.log 2>&1
grep -hE "^test result|tests exit|panicked|FAILED" /tmp/r/tests-*/tests.txt | head -12
tar czf $OUT/r.tgz -C /tmp r
ROWS="gpt-1.3b:bf16:4" LOSS_ROWS="gpt-1.3b:bf16:4" STAGES="probes losses" timeout 260 benches/gpu/builds_bench.sh /tmp/r/h128 autotune-main autotune-h128 > /tmp/r/h128.log 2>&1
tar czf $OUT/r.tgz -C /tmp r; tail -12 /tmp/r/h128/summary.md
ROWS="gpt-1.3b:bf16:4:8" ROUNDS=1 STAGES=probes timeout 80 benches/gpu/builds_bench.sh /tmp/r/accum autotune-main > /tmp/r/accum.log 2>&1
tar czf $OUT/r.tgz -C /tmp r; tail -4 /tmp/r/accum/summary.md
cp .gpu/autotune-main .gpu/autotune && timeout 150 benches/gpu/fp8_bench.sh /tmp/r/fp8 speed > /tmp/r/fp8.log 2>&1; echo "fp8 exit $?" >> /tmp/r/fp8.log
tar czf $OUT/r.tgz -C /tmp r; tail -12 /tmp/r/fp8/summary.md

# Minimal: the merged engine's GPU tests (the f16 fused products, attention), the 32-key dq
# trial's attention tests, and both on gpt-124m b16 and llama-3.2-1b mb3, alternating.
cd .gpu && for b in autotune-fin it-fin autotune-dq32 it-dq32; do xz -T4 -dc xz/$b.xz > $b; chmod +x $b; done && cp xz/libcudart.so.13 xz/gpu-env.sh . && cd .. && mkdir -p /tmp/r
source .gpu/gpu-env.sh .gpu; nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/r/gpu.txt
timeout 80 .gpu/it-fin cuda_ops::cuda_fused_linear cuda_attention::cuda_flash_engine cuda_attention::cuda_flash_attention --nocapture --test-threads=1 > /tmp/r/tests.txt 2>&1; echo "tests exit $?" >> /tmp/r/tests.txt
timeout 40 .gpu/it-dq32 cuda_attention::cuda_flash_attention cuda_attention::cuda_packed --nocapture --test-threads=1 > /tmp/r/tests-dq32.txt 2>&1; echo "tests exit $?" >> /tmp/r/tests-dq32.txt
tar czf $OUT/r.tgz -C /tmp r
for round in 1 2; do for b in autotune-fin autotune-dq32; do for spec in gpt-124m:16 llama-3.2-1b:3; do
  timeout 40 .gpu/$b probe --model ${spec%:*} --precision bf16 --micro-batch ${spec#*:} --warmup 3 --steps 10 --device cuda --gpu-capacity 24564MiB --json 2>>/tmp/r/probes.log | grep '^{' | sed "s/^{/{\"binary\":\"$b\",\"round\":$round,/" >> /tmp/r/dq32.jsonl
done; done; done
tar czf $OUT/r.tgz -C /tmp r
grep -E "test result|exit|panicked" /tmp/r/tests.txt /tmp/r/tests-dq32.txt | tail -8
python3 -c "
import json
for l in open('/tmp/r/dq32.jsonl'):
    r=json.loads(l); print(r['binary'], r['round'], r['model'], r['micro_batch'], round(r.get('tokens_per_s') or 0))"

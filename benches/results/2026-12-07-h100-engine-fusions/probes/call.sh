# gemm-epilogue with the bias in the output's dtype (autotune-bias), and that plus attention's
# whole-tile fast path and 32-query dk/dv tiles at width 64 (autotune-att, it-att), against
# f565d44 (autotune): GPU tests, then probes alternating, then 20 training steps.
cd .gpu && for b in autotune autotune-bias autotune-att it-att; do xz -dc xz/$b.xz > $b; chmod +x $b; done && cp xz/libcudart.so.13 xz/gpu-env.sh . && cd .. && mkdir -p /tmp/r
source .gpu/gpu-env.sh .gpu; nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/r/gpu.txt
timeout 150 .gpu/it-att cuda_ops::cuda_fused_linear cuda_ops::cuda_norm_backward_plus cuda_ops::cuda_cross_entropy cuda_ops::cuda_layer_norm cuda_ops::cuda_decoder_ops cuda_ops::cuda_explicit --nocapture --test-threads=1 > /tmp/r/tests-ops.txt 2>&1; echo "tests exit $?" >> /tmp/r/tests-ops.txt
timeout 150 .gpu/it-att cuda_attention:: --nocapture --test-threads=1 > /tmp/r/tests-att.txt 2>&1; echo "tests exit $?" >> /tmp/r/tests-att.txt
tar czf $OUT/r.tgz -C /tmp r
for round in 1 2; do for b in autotune autotune-bias autotune-att; do for spec in gpt-124m:16 gpt-1.3b:4 llama-3.2-1b:3; do
  timeout 90 .gpu/$b probe --model ${spec%:*} --precision bf16 --micro-batch ${spec#*:} --warmup 3 --steps 10 --device cuda --gpu-capacity 24564MiB --json 2>>/tmp/r/probes.log | grep '^{' | sed "s/^{/{\"binary\":\"$b\",\"round\":$round,/" >> /tmp/r/probes.jsonl
done; done; done
tar czf $OUT/r.tgz -C /tmp r
for b in autotune autotune-att; do for m in "gpt-124m 16" "llama-3.2-1b 3"; do set -- $m
  timeout 100 .gpu/$b train --model $1 --precision bf16 --micro-batch $2 --steps 20 --device cuda --data pattern -q --metrics /tmp/r/train-$1-$b.jsonl 2>>/tmp/r/train.log
done; done
tar czf $OUT/r.tgz -C /tmp r
for m in gpt-124m llama-3.2-1b; do for b in autotune autotune-att; do echo "$m $b $(python3 -c "import json,sys; print([round(json.loads(l)['loss'],4) for l in open(sys.argv[1]) if 'loss' in l][-5:])" /tmp/r/train-$m-$b.jsonl 2>/dev/null)"; done; done
grep -E "test result|exit|panicked|not fused" /tmp/r/tests-*.txt | tail -20
python3 -c "
import json
for l in open('/tmp/r/probes.jsonl'):
    r=json.loads(l); print(r['binary'], r['round'], r['model'], r['micro_batch'], r.get('outcome'), round(r.get('tokens_per_s') or 0), round((r.get('peak_gpu_bytes') or 0)/2**30,2))"

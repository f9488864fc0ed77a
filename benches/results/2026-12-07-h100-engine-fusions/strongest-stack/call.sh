# The headline comparisons with the chosen binary (BIN): llama-3.2-1b against transformers +
# Liger + torch.compile (recompute, mb 12), and gpt-124m b16 against torch.compile.
BIN="${BIN:?}"
cd .gpu && xz -dc xz/$BIN.xz > autotune && chmod +x autotune && cp xz/libcudart.so.13 xz/gpu-env.sh . && cd .. && mkdir -p /tmp/r
echo "binary: $BIN" > /tmp/r/which.txt
LLAMA_REF_MB= LLAMA_REF_RECOMPUTE_MB=12 timeout 560 benches/gpu/strongest_stack.sh /tmp/r/ss > /tmp/r/ss.log 2>&1
tar czf $OUT/r.tgz -C /tmp r
tail -3 /tmp/r/ss.log; cat /tmp/r/ss/summary.md

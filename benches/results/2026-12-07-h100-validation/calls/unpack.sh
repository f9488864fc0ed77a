# unpack.sh: the carried builds into .gpu/ (run from the repository root)
cd .gpu && for f in xz-*/*.xz; do b=$(basename "$f" .xz); xz -T0 -dc "$f" > "$b"; chmod +x "$b"; done
cp xz-common/libcudart.so.13 xz-common/gpu-env.sh . ; cd ..

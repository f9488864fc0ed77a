#!/usr/bin/env bash
# Fine-tunes a tiny Llama on a chat JSONL with autotune (on the CPU), exports it, and writes
# what benches/gpu/generate_check.py needs to check the export in transformers.
#
#   benches/gpu/generate_check.sh AUTOTUNE OUT_DIR
#   python3 benches/gpu/generate_check.py OUT_DIR/exported OUT_DIR/examples.jsonl \
#       OUT_DIR/prompts.json "$(cat OUT_DIR/our_loss.txt)"
set -euo pipefail
autotune=$(realpath "$1")
out=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out" && cd "$out"
python3 - "$root/tests/fixtures" <<'PY'
import json, os, shutil, sys
root = sys.argv[1]
os.makedirs("tiny-chat", exist_ok=True)
config = json.load(open(f"{root}/hf/tiny-llama/config.json"))
config.update(vocab_size=384, max_position_embeddings=128)
json.dump(config, open("tiny-chat/config.json", "w"))
shutil.copy(f"{root}/data/tokenizers/llama3/tokenizer.json", "tiny-chat/tokenizer.json")
tokenizer_config = json.load(open(f"{root}/data/tokenizers/llama3/tokenizer_config.json"))
template = json.load(open(f"{root}/data/templates/llama-3.1/tokenizer_config.json"))
tokenizer_config.update(chat_template=template["chat_template"], eos_token="<|eot_id|>")
json.dump(tokenizer_config, open("tiny-chat/tokenizer_config.json", "w"))
colours = ["red", "blue", "green", "black"]
rows = [{"messages": [{"role": "user", "content": f"Colour of {i % 4}?"},
                      {"role": "assistant", "content": colours[i % 4]}]} for i in range(24)]
open("chat.jsonl", "w").write("\n".join(json.dumps(r) for r in rows))
json.dump([[[{"role": "user", "content": f"Colour of {i}?"}], c] for i, c in enumerate(colours)],
          open("prompts.json", "w"))
PY
rm -rf ck exported
"$autotune" train --model tiny-chat --device cpu --data chat.jsonl --micro-batch 8 --epochs 60 \
    --lr 0.01 --checkpoint-dir ck --json > train.json
"$autotune" export-weights --checkpoint ck --out exported
"$autotune" data --model exported --data chat.jsonl --json > examples.jsonl
# The loss of every example at once (24 one-example sequences), before any update.
"$autotune" train --model exported --device cpu --data chat.jsonl --micro-batch 24 --steps 1 \
    --json | python3 -c "import json, sys; print(json.load(sys.stdin)['last_loss'])" > our_loss.txt

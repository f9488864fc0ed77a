"""A tiny Llama saved by `transformers` loads into autotune, trains 10 steps, is exported, and
loads back into `transformers`, which then computes what autotune's checkpoint holds.

    python3 benches/hf/roundtrip.py OUTDIR [--bin target/release/autotune] [--device cpu]

Writes OUTDIR/summary.json and prints PASS or FAIL lines; exits 1 on a failure. Needs torch,
transformers and safetensors, and an autotune binary.
"""

import argparse
import json
import pathlib
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file


def run(cmd):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bin", default="target/release/autotune")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, rope_theta=500000.0)
    src = out / "from-transformers"
    transformers.LlamaForCausalLM(config).save_pretrained(src, safe_serialization=True)

    ckpt = out / "checkpoints"
    train = run([a.bin, "train", "--model", src / "config.json", "--init-from", src,
                 "--steps", str(a.steps), "--micro-batch", "4", "--data", "pattern",
                 "--device", a.device, "--checkpoint-dir", ckpt, "--overwrite", "--json"])
    results["train"] = json.loads(train.stdout)
    hf = out / "exported"
    export = run([a.bin, "export-weights", "--checkpoint", ckpt, "--out", hf, "--json"])
    results["export"] = json.loads(export.stdout)

    # transformers loads it with no missing or unexpected weights.
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf, output_loading_info=True, torch_dtype=torch.float32)
    results["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
    clean = not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    # Its weights are autotune's checkpoint's: q/k/v and gate/up are bands of autotune's rows.
    ours = load_file(sorted(ckpt.glob("step-*"))[-1] / "model.safetensors")
    state = model.state_dict()
    worst = 0.0
    for i in range(config.num_hidden_layers):
        q = state[f"model.layers.{i}.self_attn.q_proj.weight"]
        k = state[f"model.layers.{i}.self_attn.k_proj.weight"]
        v = state[f"model.layers.{i}.self_attn.v_proj.weight"]
        worst = max(worst, (torch.cat([q, k, v]) - ours[f"blocks.{i}.attn.qkv.weight"]).abs().max().item())
    worst = max(worst, (state["model.embed_tokens.weight"] - ours["embed.weight"]).abs().max().item())
    trained = (state["model.embed_tokens.weight"] - transformers.LlamaForCausalLM.from_pretrained(src).state_dict()["model.embed_tokens.weight"]).abs().max().item()
    results["max_weight_difference"] = worst
    results["trained_embedding_change"] = trained
    # And it runs: a finite loss on a batch.
    ids = torch.randint(0, config.vocab_size, (2, 33))
    with torch.no_grad():
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss.item()
    results["transformers_loss"] = loss

    checks = {
        "loads with no missing, unexpected or mismatched weights": clean,
        "weights equal autotune's checkpoint": worst == 0.0,
        "training changed the weights": trained > 0.0,
        "transformers computes a finite loss": loss == loss and abs(loss) != float("inf"),
    }
    results["checks"] = checks
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    for name, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + name)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()

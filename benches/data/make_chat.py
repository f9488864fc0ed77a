"""A chat dataset of varied lengths and a model folder to fine-tune on it, for the packing bench.

The folder holds the Llama-3-style tokenizer of `tokenize_bench.py` (a byte-level BPE of 32,000
tokens trained on a seeded synthetic corpus, Llama 3.1's chat template, `<|eot_id|>` as EOS)
and a `config.json` of the given shape with that vocabulary; no weights (training starts from
a seeded initialisation). The conversations are `tokenize_bench.py`'s: one to three exchanges
of one to four paragraphs, an optional system prompt, so lengths range from tens of tokens to
the model's context.

    python3 benches/data/make_chat.py OUT [--conversations 24000] [--shape llama-3.2-1b]

Writes OUT/model (the folder) and OUT/chat.jsonl. Needs `tokenizers` and `transformers`.
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tokenize_bench  # noqa: E402

# Llama 3.2 1B's published shape (the vocabulary is the tokenizer's).
SHAPES = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    },
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--conversations", type=int, default=24000)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    args = parser.parse_args()
    writer = tokenize_bench.Writer(7)
    folder = args.out / "model"
    vocab = tokenize_bench.make_model(folder, writer)
    config = dict(SHAPES[args.shape])
    config["vocab_size"] = vocab
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    config["bos_token_id"] = ids["<|begin_of_text|>"]
    config["eos_token_id"] = ids["<|eot_id|>"]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with open(args.out / "chat.jsonl", "w") as f:
        for _ in range(args.conversations):
            f.write(json.dumps(writer.conversation()) + "\n")
    size = (args.out / "chat.jsonl").stat().st_size
    print(json.dumps({"conversations": args.conversations, "bytes": size, "vocab": vocab}))


if __name__ == "__main__":
    main()

"""`tokenize MB/s vs Python tokenizers`: a chat JSONL through the whole data pipeline.

autotune (`autotune data`, a fresh token cache each time) renders every conversation with the
model's chat template, finds the assistant turns, tokenizes, masks and writes the token cache.
The reference does the same work in Python, as a user of `transformers` writes it:
`apply_chat_template` for the conversation and for each assistant turn's prompt (the same
prefix rule autotune uses for the trained spans), the `tokenizers` fast tokenizer with offsets,
the mask from the offsets, and flat id and mask files. It runs twice: in one process (batch
tokenization, which the Rust tokenizer spreads over the cores) and in a pool of one process per
core (as `datasets.map(num_proc=...)` does); the faster counts. Both sides read the same file on
the same machine, and the ids and masks autotune cached are checked equal to the reference's.

The model folder is made here, deterministically: a Llama-3-style byte-level BPE of 32,000
tokens trained on a seeded synthetic corpus (a Zipf-distributed lexicon of syllable words, with
numbers, punctuation and code), Llama 3.1's chat template and `<|eot_id|>` as EOS.

    python3 benches/data/tokenize_bench.py OUT [--binary target/release/autotune]

Needs `tokenizers` and `transformers` (no PyTorch). Writes OUT/summary.json.
"""

import argparse
import array
import json
import multiprocessing
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tests/fixtures/data/templates/llama-3.1/tokenizer_config.json"
MODEL_CONFIG = ROOT / "tests/fixtures/hf/tiny-llama/config.json"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]


class Writer:
    """Seeded English-like text: syllable words drawn by a Zipf law."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w",
                  "th", "st", "pr", "tr", "ch", "sh", "gr", "cl", "br"]
        vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "io", "y"]
        codas = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "rk", "m", "x", "ck"]
        words = set()
        while len(words) < 60000:
            parts = self.rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
            words.add("".join(self.rng.choice(onsets) + self.rng.choice(vowels)
                              + self.rng.choice(codas) for _ in range(parts)))
        self.words = sorted(words)
        self.rng.shuffle(self.words)
        weights = [1.0 / (rank + 1) ** 1.07 for rank in range(len(self.words))]
        total, self.cumulative = 0.0, []
        for w in weights:
            total += w
            self.cumulative.append(total)

    def sentence(self):
        n = self.rng.randint(4, 22)
        words = self.rng.choices(self.words, cum_weights=self.cumulative, k=n)
        for i in range(len(words)):
            roll = self.rng.random()
            if roll < 0.04:
                words[i] = str(self.rng.randint(0, 99999))
            elif roll < 0.08:
                words[i] += ","
        words[0] = words[0].capitalize()
        return " ".join(words) + self.rng.choice([".", ".", ".", "?", "!", ":"])

    def code(self):
        name = self.rng.choice(self.words)
        args = ", ".join(self.rng.choices(self.words, k=self.rng.randint(1, 3)))
        body = "\n".join(f"    {self.rng.choice(self.words)} = {self.rng.choice(self.words)}"
                         f"({self.rng.randint(0, 512)})" for _ in range(self.rng.randint(2, 6)))
        return f"```python\ndef {name}({args}):\n{body}\n    return {name}\n```"

    def message(self, paragraphs):
        out = []
        for _ in range(paragraphs):
            if self.rng.random() < 0.12:
                out.append(self.code())
            else:
                out.append(" ".join(self.sentence() for _ in range(self.rng.randint(1, 5))))
        return "\n\n".join(out)

    def conversation(self):
        messages = []
        if self.rng.random() < 0.3:
            messages.append({"role": "system", "content": self.sentence()})
        for _ in range(self.rng.choice([1, 1, 2, 3])):
            messages.append({"role": "user", "content": self.message(self.rng.randint(1, 2))})
            messages.append({"role": "assistant",
                             "content": self.message(self.rng.randint(1, 4))})
        return {"messages": messages}


def make_model(folder, writer):
    """A Llama-3-style tokenizer of 32,000 tokens, its chat template and a model config."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [writer.message(3) for _ in range(12000)]
    trainer = BpeTrainer(vocab_size=32000, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIALS])
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    tokenizer.save(str(folder / "tokenizer.json"))
    template = json.loads(TEMPLATE.read_text())["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
    }))
    config = json.loads(MODEL_CONFIG.read_text())
    config["vocab_size"] = tokenizer.get_vocab_size()
    config["max_position_embeddings"] = 8192
    (folder / "config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def encode_chunk(args):
    """Render, tokenize and mask conversations: the reference's work for one chunk."""
    folder, rows, batch = args
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts, spans = [], []
    for messages in rows:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        turns = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False,
                                                   add_generation_prompt=True)
            upto = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False)
            turns.append((len(prompt), len(upto)))
        texts.append(text)
        spans.append(turns)
    ids, mask, lengths = array.array("I"), array.array("B"), []
    for start in range(0, len(texts), batch):
        encoded = tokenizer(texts[start:start + batch], add_special_tokens=False,
                            return_offsets_mapping=True)
        for row, offsets, turns in zip(encoded["input_ids"], encoded["offset_mapping"],
                                       spans[start:start + batch]):
            ids.extend(row)
            mask.extend(1 if any(a <= s < b for a, b in turns) else 0 for s, _ in offsets)
            lengths.append(len(row))
    return ids, mask, lengths


def reference(folder, data, out, processes):
    """The Python pipeline, timed from reading the file to the written id and mask files."""
    started = time.perf_counter()
    rows = [json.loads(line)["messages"] for line in open(data, encoding="utf-8")]
    if processes == 1:
        parts = [encode_chunk((str(folder), rows, 1000))]
    else:
        size = -(-len(rows) // processes)
        chunks = [(str(folder), rows[i:i + size], 1000) for i in range(0, len(rows), size)]
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            parts = pool.map(encode_chunk, chunks)
    ids, mask = array.array("I"), array.array("B")
    for part_ids, part_mask, _ in parts:
        ids.extend(part_ids)
        mask.extend(part_mask)
    with open(out / "ids.u32", "wb") as f:
        ids.tofile(f)
    with open(out / "mask.u8", "wb") as f:
        mask.tofile(f)
    return time.perf_counter() - started, ids, mask


def ours(binary, folder, data, cache):
    """autotune's pipeline: `autotune data` with an empty cache, timed as a process."""
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    out = subprocess.run([binary, "data", "--model", str(folder), "--data", str(data),
                          "--show", "0", "--cache-dir", str(cache)],
                         capture_output=True, text=True)
    took = time.perf_counter() - started
    if out.returncode != 0:
        sys.exit(f"autotune data failed:\n{out.stderr}")
    return took, out.stderr


def cached(cache):
    """The ids and trained flags of the one file in `cache`."""
    (path,) = list(cache.glob("*.tokens"))
    raw = path.read_bytes()
    examples, tokens = (int.from_bytes(raw[72:80], "little"), int.from_bytes(raw[80:88], "little"))
    at = 96 + 8 * (examples + 1)
    ids = array.array("I")
    ids.frombytes(raw[at:at + 4 * tokens])
    mask = array.array("B")
    mask.frombytes(raw[at + 4 * tokens:])
    return ids, mask


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--binary", default=str(ROOT / "target/release/autotune"))
    parser.add_argument("--conversations", type=int, default=12000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    writer = Writer(seed=37)
    folder = work / "model"
    vocab = make_model(folder, writer)
    data = work / "chat.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(args.conversations):
            f.write(json.dumps(writer.conversation()) + "\n")
    megabytes = data.stat().st_size / 1e6
    cores = os.cpu_count()

    ours_runs = [ours(args.binary, folder, data, work / "cache") for _ in range(args.repeats)]
    ours_ids, ours_mask = cached(work / "cache")
    warm_started = time.perf_counter()
    warm = subprocess.run([args.binary, "data", "--model", str(folder), "--data", str(data),
                           "--show", "0", "--cache-dir", str(work / "cache")],
                          capture_output=True, text=True)
    warm_took = time.perf_counter() - warm_started

    references = {}
    for processes in sorted({1, cores}):
        runs = [reference(folder, data, work, processes) for _ in range(args.repeats)]
        references[processes] = runs
    best_processes = min(references, key=lambda p: min(r[0] for r in references[p]))
    _, ref_ids, ref_mask = references[best_processes][0]

    ours_s = min(t for t, _ in ours_runs)
    ref_s = min(r[0] for r in references[best_processes])
    summary = {
        "metric": "tokenize MB/s vs Python tokenizers",
        "file_mb": round(megabytes, 3),
        "conversations": args.conversations,
        "tokens": len(ref_ids),
        "vocab": vocab,
        "cores": cores,
        "ours_seconds": [round(t, 3) for t, _ in ours_runs],
        "ours_mb_per_s": round(megabytes / ours_s, 3),
        "ours_from_cache_seconds": round(warm_took, 3),
        "from_cache_stderr": warm.stderr.strip().splitlines(),
        "reference_seconds": {str(p): [round(r[0], 3) for r in runs]
                              for p, runs in references.items()},
        "reference_processes": best_processes,
        "reference_mb_per_s": round(megabytes / ref_s, 3),
        "ratio": round(ref_s / ours_s, 3),
        "ids_equal": list(ours_ids) == list(ref_ids),
        "masks_equal": list(ours_mask) == list(ref_mask),
        "trained_tokens": sum(ref_mask),
        "ours_stderr": ours_runs[-1][1].strip().splitlines(),
        "python": sys.version.split()[0],
        "tokenizers": __import__("tokenizers").__version__,
        "transformers": __import__("transformers").__version__,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("ours_mb_per_s", "reference_mb_per_s", "ratio",
                                              "ids_equal", "masks_equal", "file_mb")}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""transformers fine-tuning with padded batches: the reference of `packing_bench.sh`.

A Llama built by `AutoModelForCausalLM.from_config` from the bench's model folder (fp32 weights,
bf16 autocast, SDPA attention, fused AdamW), trained on the chat dataset as a user of
`transformers` does without packing: `apply_chat_template` with the assistant turns as labels
(the rest -100), examples cut to the context, batches of `--micro-batch` examples in a seeded
order padded to their longest (as `DataCollatorForSeq2Seq` pads). Prints one JSON line: real
(non-pad) tokens/s over the timed steps, padded tokens/s, the peak memory.
"""

import argparse
import json
import random
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def examples(tokenizer, path, limit, context):
    rows = []
    with open(path) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            spans = []
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                start = len(tokenizer.apply_chat_template(messages[:k], tokenize=False,
                                                          add_generation_prompt=True))
                end = len(tokenizer.apply_chat_template(messages[:k + 1], tokenize=False))
                spans.append((start, end))
            ids = enc["input_ids"][:context + 1]
            labels = [t if any(a <= s < b for a, b in spans) else -100
                      for t, (s, _) in zip(ids, enc["offset_mapping"])]
            rows.append((ids, labels))
            if len(rows) >= limit:
                break
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = AutoConfig.from_pretrained(args.model)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    need = (args.warmup + args.steps) * args.micro_batch
    rows = examples(tokenizer, args.data, need * 2, config.max_position_embeddings)
    random.Random(0).shuffle(rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    real = padded = 0
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            started, real, padded = time.perf_counter(), 0, 0
        batch = rows[step * args.micro_batch:(step + 1) * args.micro_batch]
        width = max(len(ids) for ids, _ in batch) - 1
        inputs = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            n = len(ids) - 1
            inputs[i, :n] = torch.tensor(ids[:n])
            labels[i, :n] = torch.tensor(lab[1:n + 1])
            mask[i, :n] = 1
        real += int(mask.sum())
        padded += inputs.numel()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs.cuda(), attention_mask=mask.cuda()).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                 labels.cuda().view(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(json.dumps({
        "impl": "transformers padded", "micro_batch": args.micro_batch, "steps": args.steps,
        "real_tokens_per_s": real / seconds, "tokens_per_s": padded / seconds,
        "loss": float(loss), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }))


if __name__ == "__main__":
    main()

"""Loads a folder written by `autotune export-weights` in transformers and checks it.

    python3 generate_check.py EXPORTED EXAMPLES.jsonl PROMPTS.json [OUR_LOSS]

- EXAMPLES.jsonl: `autotune data --json` of the training data (input_ids, labels with -100 where
  the loss is masked). transformers' loss on them, token-weighted, is printed, and compared
  with OUR_LOSS (autotune's loss on the same examples) when given.
- PROMPTS.json: a list of [conversation, expected reply]: each is rendered with the folder's
  chat template (generation prompt added), generated greedily until the end of turn, and the
  reply compared with the expected one.

Prints one JSON object; exits 1 when a check fails.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    folder, examples_path, prompts_path = sys.argv[1:4]
    our_loss = float(sys.argv[4]) if len(sys.argv) > 4 else None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with open(examples_path) as f:
        for line in f:
            row = json.loads(line)
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor([row["labels"]])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1].float()
            targets = labels[0, 1:]
            keep = targets != -100
            losses = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
            total += losses.item()
            count += int(keep.sum())
    loss = total / count
    replies = []
    for conversation, expected in json.load(open(prompts_path)):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt")
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False,
                                 eos_token_id=model.generation_config.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        stopped = bool(new) and new[-1] in _ids(model.generation_config.eos_token_id)
        replies.append({"prompt": conversation[-1]["content"], "expected": expected,
                        "generated": text, "stopped_at_end_of_turn": stopped})
    result = {
        "transformers_loss": loss,
        "autotune_loss": our_loss,
        "trained_tokens": count,
        "replies": replies,
    }
    print(json.dumps(result, indent=1))
    ok = all(r["generated"] == r["expected"] and r["stopped_at_end_of_turn"] for r in replies)
    if our_loss is not None:
        ok = ok and abs(loss - our_loss) <= 1e-3 * max(1.0, our_loss)
    sys.exit(0 if ok else 1)


def _ids(eos):
    return eos if isinstance(eos, list) else [eos]


if __name__ == "__main__":
    main()

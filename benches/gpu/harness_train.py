#!/usr/bin/env python3
"""Trains a plan's model for a few steps with one of its exports, under the plan's emulated
card, to see that the exported setting trains without running out of memory:

    python3 benches/gpu/harness_train.py --tool deepspeed --plan P.plan.json --config P.deepspeed.json
    python3 benches/gpu/harness_train.py --tool trainer --plan P.plan.json --config P.trainer.json \\
        [--deepspeed-config P.deepspeed.json]

- ``deepspeed``: ``deepspeed.initialize`` with the exported config as it is (a group of one
  process), ``engine.backward`` and ``engine.step`` per micro-batch;
- ``trainer``: ``HfArgumentParser(TrainingArguments).parse_dict`` of the exported arguments
  (plus ``output_dir``, ``max_steps`` and quiet logging), then ``transformers.Trainer`` on the
  same model, wrapped to take ``input_ids`` and ``labels`` and return the loss.

The model is the harness example's (benches/gpu/torch_ref.py's, built from the plan's spec),
its blocks checkpointed as the plan says (the exports' notes ask the user to wrap them); the
card is emulated as the harness does (``autotune_harness.memory.Card``). Prints one JSON line
(last on stdout, where the Trainer logs too; ``--out`` writes it to a file as well): steps done,
out of memory or not, the peak (reserved plus outside the allocator), tokens/s over the steps
after the first, the last loss, or the error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# This folder's scripts must not shadow installed packages (its kernels.py, Hugging Face's
# kernels, which transformers imports).
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.join(ROOT, "harness", "examples"))
sys.dont_write_bytecode = True

import torch  # noqa: E402
from torch_ref_models import preset, random_tokens, torch_ref  # noqa: E402

from autotune_harness.memory import Card, is_out_of_memory  # noqa: E402
from autotune_harness.trial import checkpoint_blocks, default_loss  # noqa: E402


def build(spec: dict):
    kind = "gpt" if spec.get("causal") else "seed"
    model = torch_ref.GptModel(preset(spec, kind)) if kind == "gpt" else torch_ref.SeedModel(preset(spec, kind))
    blocks = model.blocks if kind == "gpt" else model.encoder.layers
    return model, blocks


def checkpoint_every(knobs: dict):
    c = knobs.get("checkpointing", {"mode": "none"})
    return None if c.get("mode") == "none" else int(c["k"])


class Timer:
    """Step times, the device synchronised around each step."""

    def __init__(self, device):
        self.device, self.times, self.t0 = device, [], None

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self):
        self.sync()
        self.t0 = time.perf_counter()

    def stop(self):
        self.sync()
        self.times.append(time.perf_counter() - self.t0)


def train_deepspeed(plan, config, steps, device, timer):
    import deepspeed

    from autotune_harness.offload import free_port

    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(var, value)
    deepspeed.init_distributed()
    spec = plan["model"]
    torch.manual_seed(0)
    model, blocks = build(spec)
    k = checkpoint_every(plan["knobs"])
    if k:
        checkpoint_blocks(blocks, k)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator(device=device).manual_seed(0)
    batch = random_tokens(spec, config["train_micro_batch_size_per_gpu"], device, gen)
    loss = None
    for _ in range(steps):
        timer.start()
        for _ in range(config["gradient_accumulation_steps"]):
            loss = default_loss(engine, batch)
            engine.backward(loss)
            engine.step()
        timer.stop()
    return float(loss.detach().float().item())


class LossModel(torch.nn.Module):
    """A model the Trainer can call: ``input_ids`` and ``labels`` in, ``{"loss": ...}`` out."""

    def __init__(self, model, blocks):
        super().__init__()
        self.model, self.blocks = model, blocks

    def forward(self, input_ids, labels):
        return {"loss": default_loss(self.model, (input_ids, labels))}

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1,
                                        offload=False):
        checkpoint_blocks(self.blocks, every_n_layers)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, **_):
        checkpoint_blocks(self.blocks, every_n_layers)


def train_trainer(plan, config, steps, device, timer, deepspeed_config):
    from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

    spec = plan["model"]
    knobs = plan["knobs"]
    args = dict(config)
    if "deepspeed" in args:
        if not deepspeed_config:
            raise ValueError("the Trainer export names a DeepSpeed config: pass --deepspeed-config")
        args["deepspeed"] = os.path.abspath(deepspeed_config)
    args.update(output_dir=tempfile.mkdtemp(prefix="harness-trainer-"), max_steps=steps,
                save_strategy="no", report_to=[], logging_steps=max(1, steps // 4),
                disable_tqdm=True, dataloader_num_workers=0, seed=0)
    if device.type == "cpu":
        args["use_cpu"] = True
    (targs,) = HfArgumentParser(TrainingArguments).parse_dict(args)
    torch.manual_seed(0)
    model, blocks = build(spec)
    k = checkpoint_every(knobs)
    if k and k > 1 and not args.get("gradient_checkpointing"):
        checkpoint_blocks(blocks, k)
    gen = torch.Generator().manual_seed(0)
    n = steps * knobs["micro_batch"] * knobs["grad_accum"]
    inputs, labels = random_tokens(spec, min(n, 256), torch.device("cpu"), gen)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": inputs[i % len(inputs)], "labels": labels[i % len(labels)]}

    losses = []

    class Timing(TrainerCallback):
        def on_step_begin(self, *_, **__):
            timer.start()

        def on_step_end(self, *_, **__):
            timer.stop()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trainer = Trainer(model=LossModel(model, blocks), args=targs, train_dataset=Tokens(),
                      callbacks=[Timing()])
    trainer.train()
    return losses[-1] if losses else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", choices=("deepspeed", "trainer"), required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--config", required=True, help="the export for the tool")
    ap.add_argument("--deepspeed-config", help="the DeepSpeed export, for a Trainer export that names one")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="also write the record here (the tools print on stdout too)")
    ap.add_argument("--torch-adam", action="store_true",
                    help="DeepSpeed: add optimizer.params.torch_adam (PyTorch's AdamW instead of the "
                         "FusedAdam op, for where that op does not build); recorded as a change")
    args = ap.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    with open(args.config) as f:
        config = json.load(f)
    knobs = plan["knobs"]
    changed = None
    if args.torch_adam and "optimizer" in config:
        config["optimizer"].setdefault("params", {})["torch_adam"] = True
        changed = "optimizer.params.torch_adam = true: the FusedAdam op did not build"
    record = {"tool": args.tool, "model": plan["model"]["name"], "micro_batch": knobs["micro_batch"],
              "grad_accum": knobs["grad_accum"], "steps": args.steps, "steps_done": 0,
              "out_of_memory": False, "peak_gpu_bytes": None, "tokens_per_s": None, "last_loss": None}
    if changed:
        record["config_modified"] = changed
    card = None
    if plan["device"]["kind"] == "cuda":
        card = Card()
        card.emulate(plan["device"]["gpu_memory_bytes"])
        card.start_trial()
        device = card.device
        record["device"] = card.name
        record["outside_bytes"] = card.outside
    else:
        device = torch.device("cpu")
        record["device"] = "cpu"
    timer = Timer(device)
    try:
        if args.tool == "deepspeed":
            loss = train_deepspeed(plan, config, args.steps, device, timer)
        else:
            loss = train_trainer(plan, config, args.steps, device, timer, args.deepspeed_config)
        record["last_loss"] = loss if loss is None or math.isfinite(loss) else None
    except Exception as exc:  # noqa: BLE001 - every failure is reported
        record["out_of_memory"] = is_out_of_memory(exc) if card is not None else isinstance(exc, MemoryError)
        if not record["out_of_memory"]:
            record["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        import traceback

        traceback.print_exc()
    record["steps_done"] = len(timer.times)
    if card is not None:
        record["peak_gpu_bytes"] = card.peak()
    times = sorted(timer.times[1:])
    if times:
        median = times[len(times) // 2]
        record["tokens_per_s"] = knobs["micro_batch"] * knobs["grad_accum"] * plan["model"]["seq_len"] / median
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Loads autotune's exports in each tool's own config class:

    python3 validate_exports.py DIR > validate.json

DIR holds, for the plans `seed` and `gpt-2b`, `PLAN.deepspeed.json`, `PLAN.trainer.json`,
`PLAN.lightning.json` and `PLAN.accelerate.yaml` (from `autotune export --format F
--allow-engine-mismatch`). DeepSpeed's `DeepSpeedConfig`, transformers'
`HfArgumentParser(TrainingArguments).parse_dict`, Accelerate's `load_config_from_file` and
`lightning.Trainer(**kwargs)` each take their document, or the line says why not. Needs
deepspeed importable (the wheels, see offload_bench.sh) and a GPU for Lightning's accelerator.
"""
import json, sys, os, tempfile, traceback
d = sys.argv[1]
ok = {}
def run(name, fn):
    try:
        fn(); ok[name] = "ok"
    except Exception as e:
        ok[name] = "FAIL: " + repr(e)[:400]
for m in ["seed", "gpt-2b"]:
    ds = json.load(open(f"{d}/{m}.deepspeed.json"))
    tr = json.load(open(f"{d}/{m}.trainer.json"))
    li = json.load(open(f"{d}/{m}.lightning.json"))
    acc = f"{d}/{m}.accelerate.yaml"
    def ds_check():
        from deepspeed.runtime.config import DeepSpeedConfig
        DeepSpeedConfig(dict(ds))
    run(f"{m} deepspeed DeepSpeedConfig", ds_check)
    def tr_check():
        from transformers import HfArgumentParser, TrainingArguments
        args = dict(tr); args["output_dir"] = tempfile.mkdtemp()
        if "deepspeed" in args:
            p = os.path.join(os.getcwd(), "ds_config.json"); json.dump(ds, open(p, "w")); args["deepspeed"] = p
        (ta,) = HfArgumentParser(TrainingArguments).parse_dict(args)
        assert ta.per_device_train_batch_size == tr["per_device_train_batch_size"]
        assert ta.max_grad_norm == tr["max_grad_norm"]
    run(f"{m} trainer HfArgumentParser.parse_dict", tr_check)
    def acc_check():
        from accelerate.commands.config.config_args import load_config_from_file
        c = load_config_from_file(acc)
        assert str(c.mixed_precision).endswith(("bf16", "fp16", "no")), c.mixed_precision
    run(f"{m} accelerate load_config_from_file", acc_check)
    def li_check():
        import lightning
        kw = dict(li)
        if kw["strategy"].startswith("deepspeed"):
            kw["strategy"] = kw["strategy"]  # needs deepspeed importable
        lightning.Trainer(accelerator="gpu", logger=False, enable_checkpointing=False, **kw)
    run(f"{m} lightning Trainer(**kwargs)", li_check)
print(json.dumps(ok, indent=1))

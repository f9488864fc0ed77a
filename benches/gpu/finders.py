#!/usr/bin/env python3
"""Batch-size finders of PyTorch Lightning and Hugging Face Accelerate, for comparison with
`autotune tune` on the same model, precision and memory cap.

    python3 benches/gpu/finders.py --model seed --precision bf16
    python3 benches/gpu/finders.py --model gpt-124m --finders accelerate --cap-mib 24052

For each finder (each in its own child process, so that the fragmentation one leaves behind
cannot affect the other) this

1. builds torch_ref.py's model and training loop (same presets, optimizers, bf16 autocast),
   under a cap on PyTorch's allocator (default 24052 MiB: a 24564 MiB RTX 4090 minus 512 MiB
   for the CUDA context, as in the reference measurements);
2. runs the finder and times it, counting its trials (training attempts at one batch size):
   - `lightning-binsearch`: `Tuner(trainer).scale_batch_size(model, mode="binsearch",
     steps_per_trial=3, init_val=32 (seed) or 1 (others), max_trials=25)`, `precision="bf16-mixed"`,
     a dataloader of random tokens;
   - `accelerate`: `find_executable_batch_size(starting_batch_size=8192 (seed) or 64 (others))`
     around a function that runs 3 real training steps at the batch size it is given
     (`Accelerator(mixed_precision="bf16")`);
3. goes on in the same process, as a user would, to train at the batch size found: 2 warm-up and
   6 timed steps, with the finder's own framework, and reports tokens/s (or that it ran out of
   memory).

One JSON line per finder on stdout:

    {"finder": "lightning-binsearch", "model": "seed", "precision": "bf16", "batch": 703,
     "wall_s": 8.4, "trials": 15, "tokens_per_s": 1.2e6, "oom_after": false, ...}

plus `trial_batches` (every batch size tried, in order), `cap_mib`, `torch`/framework versions,
and `error` when the finder itself failed. Without CUDA each finder prints
`{"finder": ..., "skipped": "no CUDA", ...}` unless `--simulate-oom-above` asks for a CPU dry run
(the tiny model on the CPU, with an out-of-memory error raised above that many sequences per
batch: it checks this script, not the finders).
Progress and the frameworks' logs go to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # importing torch_ref must not leave __pycache__ in the checkout

FINDERS = ("lightning-binsearch", "accelerate")
STEPS_PER_TRIAL = 3
WARMUP_AFTER = 2
TIMED_AFTER = 6


def log(msg: str) -> None:
    print(f"finders.py: {msg}", file=sys.stderr, flush=True)


def default_start(finder: str, model: str) -> int:
    if finder == "lightning-binsearch":
        return 32 if model == "seed" else 1
    return 8192 if model == "seed" else 64


# ---------------------------------------------------------------------------
# Shared pieces (child side)
# ---------------------------------------------------------------------------

class Setup:
    """Device, cap, preset and the simulated-OOM hook shared by both finders."""

    def __init__(self, args):
        import torch
        import torch_ref

        self.torch = torch
        self.torch_ref = torch_ref
        self.p = torch_ref.PRESETS[args.model]
        self.precision = args.precision
        self.dtype = torch_ref.DTYPES[args.precision]
        self.simulate = args.simulate_oom_above
        self.cap_mib = None
        if self.simulate is None:
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            self.device = torch.device("cuda", 0)
            total = torch.cuda.get_device_properties(self.device).total_memory
            if args.cap_mib and args.cap_mib * 2**20 < total:
                torch.cuda.set_per_process_memory_fraction(args.cap_mib * 2**20 / total, self.device)
                self.cap_mib = args.cap_mib
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(args.seed)

    def check_simulated_oom(self, batch: int) -> None:
        # Same message shape as a real CUDA OOM, which both frameworks recognise.
        if self.simulate is not None and batch > self.simulate:
            raise self.torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {batch} sequences (simulated above {self.simulate})")

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def tokens_per_s(self, batch: int, times: list[float]) -> float | None:
        if not times:
            return None
        median = self.torch_ref.percentile(sorted(times), 0.5)
        return batch * self.p.seq_len / median if median > 0 else None


def setup_s(args) -> float | None:
    """Seconds from the parent starting this finder's process to the finder's call: the
    interpreter, the framework's imports, the model and the trainer. A tool that searches from a
    fresh process pays the same, so it belongs in a comparison with one."""
    return time.time() - args.started_at if args.started_at else None


def is_oom(exc: BaseException) -> bool:
    import torch_ref
    msg = str(exc)
    return torch_ref.is_oom(exc) or (isinstance(exc, RuntimeError) and "out of memory" in msg.lower())


def random_token_dataset(torch, p, length: int, pool: int, seed: int):
    """Map-style dataset of `length` (input, target) pairs of uniform random tokens, drawn from a
    pool so that a long epoch costs no memory."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, p.vocab, (pool, p.seq_len), generator=gen)
    targets = torch.randint(0, p.vocab, (pool, p.seq_len), generator=gen)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return length

        def __getitem__(self, i):
            return inputs[i % pool], targets[i % pool]

    return Tokens()


# ---------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------

def run_lightning(args, s: Setup) -> dict:
    torch = s.torch
    F = torch.nn.functional
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner import Tuner
        version = pl.__version__
    except ImportError:
        import pytorch_lightning as pl
        from pytorch_lightning.tuner import Tuner
        version = pl.__version__
    p = s.p
    trials: list[int] = []
    step_times: list[float] = []
    max_val = 8192
    # Longer than any batch Lightning may try (it stops at the dataset's length).
    dataset = random_token_dataset(torch, p, length=4 * max_val, pool=1024 if p.seq_len <= 256 else 64,
                                   seed=args.seed)

    class Module(pl.LightningModule):
        def __init__(self, batch_size: int):
            super().__init__()
            self.model = s.torch_ref.build_model(p)
            self.batch_size = batch_size

        def training_step(self, batch, batch_idx):
            s.check_simulated_oom(batch[0].shape[0])
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, p.vocab), y.reshape(-1))

        def configure_optimizers(self):
            # Called after the module has been moved to its device (fused AdamW needs that).
            return s.torch_ref.build_optimizer(p, self.model, self.device)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=False,
                                               num_workers=0, pin_memory=self.device.type == "cuda")

        def on_train_start(self):
            # Once per fit: once per finder trial, then once for the real run.
            trials.append(self.batch_size)

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            s.sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            s.sync()
            step_times.append(time.perf_counter() - self.t0)

    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}[s.precision]
    root = tempfile.mkdtemp(prefix="finder-lightning-")
    trainer = pl.Trainer(
        accelerator="gpu" if s.device.type == "cuda" else "cpu", devices=1, precision=precision,
        max_steps=WARMUP_AFTER + TIMED_AFTER, max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
        callbacks=[StepTimer()],
    )
    module = Module(batch_size=args.start or default_start("lightning-binsearch", args.model))
    s.sync()
    setup = setup_s(args)
    t0 = time.perf_counter()
    found = Tuner(trainer).scale_batch_size(
        module, mode="binsearch", steps_per_trial=STEPS_PER_TRIAL,
        init_val=args.start or default_start("lightning-binsearch", args.model), max_trials=25)
    s.sync()
    wall = time.perf_counter() - t0
    n_trials = len(trials)
    trial_batches = list(trials)
    log(f"lightning-binsearch: batch {found} in {wall:.1f} s, {n_trials} trials {trial_batches}")

    # The run a user makes next: the same trainer and module at the batch size found.
    step_times.clear()
    oom_after, tps, err = False, None, None
    if found:
        try:
            trainer.fit(module)
            tps = s.tokens_per_s(found, step_times[WARMUP_AFTER:])
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                err = f"timed run: {type(exc).__name__}: {str(exc)[:300]}"
            oom_after = is_oom(exc)
    shutil.rmtree(root, ignore_errors=True)
    return {"batch": found, "wall_s": wall, "setup_s": setup, "trials": n_trials,
            "trial_batches": trial_batches,
            "tokens_per_s": tps, "oom_after": oom_after, "timed_steps": len(step_times[WARMUP_AFTER:]),
            "framework": f"lightning {version}", **({"error": err} if err else {})}


# ---------------------------------------------------------------------------
# Accelerate
# ---------------------------------------------------------------------------

def run_accelerate(args, s: Setup) -> dict:
    torch = s.torch
    F = torch.nn.functional
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    p = s.p
    mixed = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[s.precision]
    accelerator = Accelerator(mixed_precision=mixed, cpu=s.device.type == "cpu")
    device = accelerator.device
    model = s.torch_ref.build_model(p).to(device)
    model.train()
    optimizer = s.torch_ref.build_optimizer(p, model, device)
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        with accelerator.autocast():
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, p.vocab), targets.reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        return loss

    def batch_of(n):
        s.check_simulated_oom(n)
        inputs = torch.randint(0, p.vocab, (n, p.seq_len), device=device, generator=gen)
        targets = torch.randint(0, p.vocab, (n, p.seq_len), device=device, generator=gen)
        return inputs, targets

    trials: list[int] = []
    start = args.start or default_start("accelerate", args.model)

    @find_executable_batch_size(starting_batch_size=start)
    def probe(batch_size):
        trials.append(batch_size)
        inputs, targets = batch_of(batch_size)
        for _ in range(STEPS_PER_TRIAL):
            step(inputs, targets)
        s.sync()
        return batch_size

    s.sync()
    setup = setup_s(args)
    t0 = time.perf_counter()
    err = None
    try:
        found = probe()
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        found, err = None, f"finder: {str(exc)[:300]}"
    wall = time.perf_counter() - t0
    log(f"accelerate: batch {found} in {wall:.1f} s, {len(trials)} trials {trials}")

    # Training goes on at the batch size found, with the same model and optimizer.
    oom_after, tps, times = False, None, []
    if found:
        try:
            inputs, targets = batch_of(found)
            for _ in range(WARMUP_AFTER):
                step(inputs, targets)
            s.sync()
            for _ in range(TIMED_AFTER):
                s.sync()
                t = time.perf_counter()
                step(inputs, targets)
                s.sync()
                times.append(time.perf_counter() - t)
            tps = s.tokens_per_s(found, times)
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                err = f"timed run: {type(exc).__name__}: {str(exc)[:300]}"
            oom_after = is_oom(exc)
    return {"batch": found, "wall_s": wall, "setup_s": setup, "trials": len(trials), "trial_batches": trials,
            "tokens_per_s": tps, "oom_after": oom_after, "timed_steps": len(times),
            "framework": f"accelerate {accelerate.__version__}", **({"error": err} if err else {})}


# ---------------------------------------------------------------------------
# Parent / child plumbing
# ---------------------------------------------------------------------------

def base_record(args, finder: str) -> dict:
    return {"finder": finder, "model": args.model, "precision": args.precision, "batch": None,
            "wall_s": None, "trials": None, "tokens_per_s": None, "oom_after": None,
            "start": args.start or default_start(finder, args.model), "steps_per_trial": STEPS_PER_TRIAL,
            "cap_mib": None if args.simulate_oom_above is not None else args.cap_mib}


def child(args) -> int:
    rec = base_record(args, args.finder)
    try:
        s = Setup(args)
        rec["cap_mib"] = s.cap_mib
        rec["torch"] = s.torch.__version__
        rec["device"] = (s.torch.cuda.get_device_name(s.device) if s.device.type == "cuda"
                         else "cpu (simulated OOM above %d)" % args.simulate_oom_above)
        run = run_lightning if args.finder == "lightning-binsearch" else run_accelerate
        rec.update(run(args, s))
    except Exception as exc:  # noqa: BLE001 - reported in the record
        import traceback
        traceback.print_exc()
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    for key in ("wall_s", "tokens_per_s"):
        if isinstance(rec.get(key), float) and not math.isfinite(rec[key]):
            rec[key] = None
    with open(args.result_file, "w") as f:
        json.dump(rec, f)
    return 0


def parent(args) -> int:
    finders = [f for f in args.finders.split(",") if f]
    for f in finders:
        if f not in FINDERS:
            print(f"finders.py: unknown finder {f!r} (known: {', '.join(FINDERS)})", file=sys.stderr)
            return 2
    if args.simulate_oom_above is None:
        try:
            import torch
            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if not cuda:
            for f in finders:
                print(json.dumps({**base_record(args, f), "skipped": "no CUDA"}), flush=True)
            return 0
    # A SIGTERM (an outer `timeout`) must not leave a child holding GPU memory behind:
    # SystemExit makes subprocess.run kill the running child before it propagates.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    end = time.monotonic() + args.total_timeout if args.total_timeout else None
    for f in finders:
        child_timeout = args.timeout
        if end is not None:
            left = end - time.monotonic()
            if left < 15:
                print(json.dumps({**base_record(args, f), "skipped": "time limit"}), flush=True)
                continue
            child_timeout = min(child_timeout, left)
        fd, result = tempfile.mkstemp(prefix="finder-", suffix=".json")
        os.close(fd)
        cmd = [sys.executable, os.path.abspath(__file__), "--finder", f, "--result-file", result,
               "--model", args.model, "--precision", args.precision, "--cap-mib", str(args.cap_mib),
               "--seed", str(args.seed), "--started-at", repr(time.time())]
        if args.start:
            cmd += ["--start", str(args.start)]
        if args.simulate_oom_above is not None:
            cmd += ["--simulate-oom-above", str(args.simulate_oom_above)]
        log(f"running {f}: {' '.join(cmd)}")
        t0 = time.perf_counter()
        rec = None
        try:
            # The child's stdout (framework chatter) joins our stderr; its result comes by file.
            proc = subprocess.run(cmd, stdout=sys.stderr, timeout=child_timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            with open(result) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            rec = None
        finally:
            os.unlink(result)
        if rec is None:
            why = f"timed out after {child_timeout:.0f} s" if rc == "timeout" else f"exited {rc}"
            rec = {**base_record(args, f), "error": f"finder process {why} without a result"}
        rec["process_s"] = time.perf_counter() - t0
        print(json.dumps(rec), flush=True)
        gc.collect()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="seed", help="a torch_ref.py preset (seed, gpt-124m, ...)")
    ap.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--finders", default=",".join(FINDERS),
                    help=f"comma-separated, run in this order (default {','.join(FINDERS)})")
    ap.add_argument("--cap-mib", type=int, default=24564 - 512,
                    help="cap on PyTorch's allocator in MiB (default 24052: a 24564 MiB card minus 512 MiB "
                         "of CUDA context); 0 = uncapped")
    ap.add_argument("--start", type=int, default=0,
                    help="first batch size (default: Lightning 32 for seed, else 1; Accelerate 8192 for seed, "
                         "else 64)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per finder process")
    ap.add_argument("--total-timeout", type=float, default=0,
                    help="seconds for all finders together; a finder that would get under 15 s is skipped "
                         "(default: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate-oom-above", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--finder", choices=FINDERS, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    ap.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch_ref  # noqa: F401 - fail early on a bad checkout
    if args.model not in torch_ref.PRESETS:
        ap.error(f"--model must be one of {', '.join(torch_ref.PRESETS)}")
    if args.finder:
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

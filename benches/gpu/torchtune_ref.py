#!/usr/bin/env python3
"""torchtune's `full_finetune_single_device` recipe for Llama-3.1-8B, as a benchmark script.

Reproduces the training step of torchtune 0.6.1's `recipes/full_finetune_single_device.py` with
its `llama3_1/8B_full_single_device` config, the setting torchtune publishes for one RTX 4090
(its README: batch 2, dataset packed to 2048 tokens, compile on: 18.9 GiB peak, 1650 tokens/s):

    PYTHONPATH=/tmp/tt_site python3 benches/gpu/torchtune_ref.py --batch 2 --seq 2048 \\
        --steps 6 --warmup 2 --cap-mib 24564 --out tt-b2.json
    PYTHONPATH=/tmp/tt_site python3 benches/gpu/torchtune_ref.py --sweep 1,2,4 --seq 2048 \\
        --cap-mib 24564 --out tt-sweep.json      # one fresh process per batch size
    python3 benches/gpu/torchtune_ref.py --tiny --steps 2 --warmup 1 --out /tmp/tiny.json

Kept from the recipe and config:

- `torchtune.models.llama3_1.llama3_1_8b()` built in bf16 directly on the device
  (`training.set_default_dtype` + the device context, as `_setup_model` does), all parameters
  bf16 (`training.validate_expected_param_dtype`);
- activation checkpointing of every `modules.TransformerSelfAttentionLayer`
  (`training.set_activation_checkpointing`), activation offloading off;
- the optimizer step in backward (`optimizer_in_bwd: True`): one
  `bitsandbytes.optim.PagedAdamW8bit(lr=2e-5)` per parameter, stepped and zeroed by a
  post-accumulate-grad hook (`training.register_optim_in_bwd_hooks`, plus the
  `training.create_optim_in_bwd_wrapper` the recipe keeps for checkpoints); bitsandbytes
  synchronizes the device after each parameter's update;
- `modules.loss.CEWithChunkedOutputLoss` (8 chunks) with `model.set_num_output_chunks`, labels
  shifted by appending an `ignore_index` column, and `(loss * num_tokens).backward()` without a
  gradient rescale (the recipe rescales only when the optimizer is not in backward);
- no gradient clipping, no learning-rate schedule, no gradient accumulation; compile off as in
  the config (`--compile` applies `training.compile_model` / `training.compile_loss` as the
  recipe does with `compile: True`, the README's setting).

Different from a real run: random weights (no checkpoint: the recipe first loads the 16 GB state
dict into host memory, so its host peak is higher), random token batches of exactly `--seq`
tokens with every label counted (alpaca examples are padded to the longest in the batch and their
prompts masked), a fixed seed, and no tokenizer, dataloader, metric logging or checkpoint save.

Memory: `--cap-mib` caps PyTorch's caching allocator with `set_per_process_memory_fraction`.
The paged optimizer state (CUDA managed memory, about 2 bytes per parameter) lies outside that
allocator: the cap does not limit it and `max_memory_allocated` does not count it. A 24 GB card
pages it between host and device; a larger GPU would keep it resident and run faster than the
real card. So with `--cap-mib` the rest of the GPU is also held back, allocated outside PyTorch
(`held_back_bytes`), and the paged state competes for the card's memory as on the real one
(`--fraction-only` skips that). `paged_state_bytes` and `device_used_bytes_max` (device-wide use
from `cudaMemGetInfo` after each step) show it. An out-of-memory error is an outcome
(`"oom": true`), not a failure.

torchtune imports Hugging Face `datasets`, `sentencepiece` and `tiktoken` when it is imported;
none is used here, so a missing one is replaced by a placeholder module (listed in
`stubbed_modules`) that raises if called.

Writes one JSON object to `--out` (with `--sweep`: {"sweep": [one object per batch]}) and prints
it on stdout; progress goes to stderr. `--tiny` builds a two-layer Llama-3.1 that runs on the CPU
(torch.optim.AdamW there, still stepped in backward) to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
import types

import torch

HERE = pathlib.Path(__file__).resolve().parent
# This folder's kernels.py would shadow the `kernels` package that bitsandbytes may import.
sys.path = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE]

LR = 2e-5
VOCAB = 128_256
TINY = {"vocab_size": 1024, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 128,
        "max_seq_len": 512, "intermediate_dim": 256}
# What torchtune 0.6.1 imports from each optional package when `torchtune` is imported.
IMPORTED_AT_LOAD = {
    "datasets": ["load_dataset"],
    "datasets.distributed": ["split_dataset_by_node"],
    "sentencepiece": ["SentencePieceProcessor"],
    "tiktoken": ["Encoding"],
    "tiktoken.load": ["load_tiktoken_bpe"],
}


def stub_unused_imports() -> list[str]:
    """Placeholder modules for the dataset and tokenizer packages torchtune imports but this script
    never calls; only for packages that are not installed. Returns the stubbed package names."""
    stubbed = []
    for name, attrs in IMPORTED_AT_LOAD.items():
        root = name.split(".")[0]
        if root not in stubbed and (root in sys.modules or importlib.util.find_spec(root) is not None):
            continue
        module = types.ModuleType(name)
        module.__path__ = []

        def unavailable(*_args, _name=name, **_kwargs):
            raise ImportError(f"{_name} is not installed (torchtune_ref.py stands in a placeholder)")

        for attr in attrs:
            setattr(module, attr, unavailable)
        sys.modules[name] = module
        if "." in name:
            setattr(sys.modules[root], name.split(".", 1)[1], module)
        elif root not in stubbed:
            stubbed.append(root)
    return stubbed


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def host_peaks() -> dict:
    """Peak resident set size of this process: getrusage's ru_maxrss and /proc's VmHWM."""
    out = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "vm_hwm_bytes": None}
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["vm_hwm_bytes"] = int(line.split()[1]) * 1024
    return out


class Run:
    """One batch size in this process: setup, warm-up and timed steps, and what was measured."""

    def __init__(self, args, device: torch.device, stubbed: list[str]):
        self.a = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.result = {
            "impl": "torchtune", "recipe": "full_finetune_single_device",
            "config": "llama3_1/8B_full_single_device" if not args.tiny else "tiny",
            "model": "llama3_1_8b" if not args.tiny else "llama3_1-tiny",
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "cap_mib": args.cap_mib or None, "compile": args.compile, "device": str(device),
            "stubbed_modules": stubbed, "oom": False, "oom_phase": None,
            "torch": torch.__version__,
        }
        self.device_used_max = 0
        self.total_bytes = 0

    def sample_device(self) -> None:
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_used_max = max(self.device_used_max, total - free)

    def setup(self):
        import torchtune
        from torchtune import modules, training
        from torchtune.models import llama3_1
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        self.result["torchtune"] = torchtune.__version__
        torch.manual_seed(self.a.seed)
        with training.set_default_dtype(torch.bfloat16), self.device:
            model = llama3_1.llama3_1(**TINY) if self.a.tiny else llama3_1.llama3_1_8b()
        if self.a.compile:
            training.compile_model(model)
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        training.validate_expected_param_dtype(model.named_parameters(), dtype=torch.bfloat16)
        self.act_ctx = training.get_act_offloading_ctx_manager(model, False)
        self.result["params"] = sum(p.numel() for p in model.parameters())
        self.vocab = TINY["vocab_size"] if self.a.tiny else VOCAB

        if self.cuda:
            import bitsandbytes as bnb

            self.result["bitsandbytes"] = bnb.__version__
            self.result["optimizer"] = "bitsandbytes.optim.PagedAdamW8bit"

            def make_optim(p):
                return bnb.optim.PagedAdamW8bit([p], lr=LR)
        else:
            self.result["optimizer"] = "torch.optim.AdamW"

            def make_optim(p):
                return torch.optim.AdamW([p], lr=LR)

        optim_dict = {p: make_optim(p) for p in model.parameters()}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        self.optim_wrapper = training.create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)

        loss_fn = CEWithChunkedOutputLoss()
        if self.a.compile:
            training.compile_loss(loss_fn)
        model.set_num_output_chunks(loss_fn.num_output_chunks)
        self.model, self.loss_fn, self.optim_dict = model, loss_fn, optim_dict
        self.ignore_labels_cache = torch.full((self.a.batch, 1), loss_fn.ignore_index, device=self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(self.a.seed + 1)
        model.train()

    def batch(self):
        tokens = torch.randint(0, self.vocab, (self.a.batch, self.a.seq), device=self.device, generator=self.gen)
        return {"tokens": tokens, "labels": tokens.clone()}

    def step(self, batch: dict) -> float:
        """The recipe's loop body with optimizer_in_bwd=True and gradient_accumulation_steps=1."""
        num_tokens = (batch["labels"] != self.loss_fn.ignore_index).sum()
        labels = batch.pop("labels")
        with self.act_ctx:
            logits = self.model(**batch)
        labels = torch.hstack((labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]]))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = self.loss_fn(logits, labels)
        del logits
        current_loss = loss * num_tokens
        current_loss.backward()  # each parameter's optimizer steps in its gradient hook
        return current_loss.item() / num_tokens.item()

    def paged_state_bytes(self) -> int:
        total = 0
        for opt in self.optim_dict.values():
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and getattr(v, "is_paged", False):
                        total += v.numel() * v.element_size()
        return total

    def measure(self) -> dict:
        r = self.result
        phase = "setup"
        losses, times = [], []
        try:
            self.sample_device()
            self.setup()
            self.sync()
            self.sample_device()
            r["setup_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
            for i in range(self.a.warmup + self.a.steps):
                phase = f"step {i + 1}"
                b = self.batch()
                self.sync()
                t0 = time.perf_counter()
                losses.append(self.step(b))
                self.sync()
                dt = time.perf_counter() - t0
                self.sample_device()
                if i >= self.a.warmup:
                    times.append(dt)
                print(f"  batch {self.a.batch} {phase}{' (warm-up)' if i < self.a.warmup else ''}: "
                      f"loss {losses[-1]:.4f}, {dt:.2f} s", file=sys.stderr, flush=True)
        except Exception as exc:  # an out-of-memory error is an outcome; anything else is raised
            if not is_oom(exc):
                raise
            r["oom"], r["oom_phase"] = True, phase
            r["error"] = str(exc).splitlines()[0][:400] if str(exc) else type(exc).__name__
        r["loss"] = losses
        r["step_times_s"] = times
        total = sum(times)
        r["tokens_per_s"] = self.a.batch * self.a.seq * len(times) / total if times and not r["oom"] else None
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            r["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
            r["max_memory_reserved"] = torch.cuda.max_memory_reserved(self.device)
            r["peak_active_bytes"] = stats.get("active_bytes.all.peak")
            r["device_used_bytes_max"] = self.device_used_max
            r["device_total_bytes"] = self.total_bytes
            with contextlib.suppress(Exception):
                r["paged_state_bytes"] = self.paged_state_bytes()
        r.update(host_peaks())
        return r

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def run_one(a, stubbed: list[str]) -> dict:
    cuda = torch.cuda.is_available() and not a.cpu
    if not cuda and not a.tiny:
        sys.exit("torchtune_ref.py: needs a CUDA GPU (or --tiny for the CPU check)")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run = Run(a, device, stubbed)
    if cuda:
        run.total_bytes = torch.cuda.get_device_properties(device).total_memory
        if a.cap_mib:
            fraction = min(1.0, a.cap_mib * 2**20 / run.total_bytes)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            if not a.fraction_only:
                run.result["held_back_bytes"] = hold_back(device, run.total_bytes - a.cap_mib * 2**20)
    return run.measure()


_HELD = []


def hold_back(device, nbytes: int) -> int:
    """Makes the GPU as small as the card it stands for: allocates `nbytes` outside PyTorch's
    allocator (the driver's cuMemAlloc in the context PyTorch made current), so that CUDA managed
    memory, which the paged optimizer state lives in and the allocator cap does not limit, can
    stay resident only in what a real card of `--cap-mib` has. Returns the bytes held."""
    import ctypes
    if nbytes <= 0:
        return 0
    torch.empty(1, device=device)  # the runtime makes its primary context current here
    libcuda = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64(0)
    rc = libcuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc_v2 of {nbytes} bytes to hold the GPU back failed: CUresult {rc}")
    _HELD.append(ptr)
    return nbytes


def sweep(a) -> dict:
    """One fresh process per batch size: an out-of-memory error and paged memory leave state behind."""
    results = []
    passthrough = ["--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--cap-mib", str(a.cap_mib), "--seed", str(a.seed)]
    passthrough += ["--fraction-only"] if a.fraction_only else []
    passthrough += [flag for flag, on in (("--compile", a.compile), ("--tiny", a.tiny), ("--cpu", a.cpu)) if on]
    with tempfile.TemporaryDirectory() as tmp:
        for b in [int(x) for x in a.sweep.split(",") if x.strip()]:
            out = pathlib.Path(tmp) / f"b{b}.json"
            cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--batch", str(b), "--out", str(out),
                   *passthrough]
            print(f"torchtune_ref: batch {b}", file=sys.stderr, flush=True)
            try:
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=a.child_timeout, check=False)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if out.exists():
                r = json.loads(out.read_text())
            else:
                r = {"impl": "torchtune", "batch": b, "seq": a.seq, "oom": False,
                     "error": f"process exit {rc}" if rc != "timeout" else f"timeout after {a.child_timeout} s"}
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    return {"sweep": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--cap-mib", type=int, default=0, help="cap PyTorch's allocator at this many MiB (0: none)")
    ap.add_argument("--fraction-only", action="store_true",
                    help="with --cap-mib, only cap PyTorch's allocator; by default the rest of the GPU is "
                         "also held back, so that the paged optimizer state cannot stay on the device")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--sweep", default="", help="comma-separated batch sizes, one process each")
    ap.add_argument("--compile", action="store_true", help="torch.compile model and loss as the recipe does")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child-timeout", type=int, default=1800, help="seconds per batch size in --sweep")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sweep:
        doc = sweep(a)
    else:
        stubbed = stub_unused_imports()
        doc = run_one(a, stubbed)
    text = json.dumps(doc)
    pathlib.Path(a.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch's exact largest feasible micro-batch for a plan's knobs, by bisection with real steps
through a trial runner (the same runner and cap the plan was tuned with), to judge the plan:

    python3 benches/gpu/harness_exact.py --plan OUT/gpt-124m.plan.json --out OUT/gpt-124m.exact.json \\
        -- python3 harness/examples/gpt_runner.py

Speaks the trial protocol (docs/trial-protocol.md) to the runner, asking the plan's regime and
accumulation at one micro-batch after another, with the search trials' warm-up and timed steps,
the plan's device capacity and host budget. Feasible means what it means to autotune: the trial
fits and its peaks stay within the plan's budget less its headroom. The bisection grows from the
plan's micro-batch by doubling to the first infeasible one, then halves the bracket to the exact
boundary; it then does the same for the largest micro-batch that runs at all (peaks inside the
headroom count). Micro-batches above the search's own largest (``--profile``) are not tried. The runner runs under
the plan's allocator setting (``PYTORCH_CUDA_ALLOC_CONF``, as autotune gave it to the tune's
runner), or the one ``--allocator`` names. Writes one JSON document: both boundaries, the plan's micro-batch, their ratio,
whether the plan is within 2 % of the feasible boundary, and every trial. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

TOLERANCE = 0.02
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATORS = {"expandable": "expandable_segments:True", "default": ""}


class Runner:
    """A trial runner process, restarted when it cannot serve the next trial, or for every
    trial with ``fresh`` (the reference's default: a process that already ran a trial can peak
    lower at the same micro-batch than a fresh one, and a training run starts fresh)."""

    def __init__(self, argv, log, fresh=True, allocator=None):
        self.argv, self.log, self.fresh = argv, log, fresh
        # PYTORCH_CUDA_ALLOC_CONF for the runner: None leaves ours, "" removes it.
        self.allocator = allocator
        self.proc = None
        self.lines: queue.Queue = queue.Queue()
        self.started = 0

    def _start(self):
        env = dict(os.environ, AUTOTUNE_PROTOCOL="1")
        if self.allocator is not None:
            env.pop(ALLOC_CONF, None)
            if self.allocator:
                env[ALLOC_CONF] = self.allocator
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        self.started += 1
        self.lines = queue.Queue()
        out, lines = self.proc.stdout, self.lines

        def read():
            for line in out:
                line = line.strip()
                if line.startswith("{") and '"protocol"' in line:
                    lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            self.proc = None

    def ask(self, request: dict, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                return {"outcome": "timed_out"}
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                self.stop()
                return {"outcome": "crashed", "reason": f"runner exited {code} without a reply"}
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue
            if self.fresh or not reply.get("reusable"):
                self.stop()
            return reply


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", help="the search's recording: its space's largest micro-batch bounds "
                                      "the bisection too")
    ap.add_argument("--max-micro-batch", type=int, default=None,
                    help="the largest micro-batch to try (default: the profile's, else 4096)")
    ap.add_argument("--trial-timeout", type=float, default=300)
    ap.add_argument("--total-timeout", type=float, default=0, help="seconds for all trials (0: none)")
    ap.add_argument("--log", default=None, help="the runner's stderr (default: ours)")
    ap.add_argument("--scan", action="store_true",
                    help="also try every micro-batch from the plan's up to the bisection's boundary "
                         "(contiguous_max: the largest below which every one tried fits)")
    ap.add_argument("--reuse-runner", action="store_true",
                    help="let one runner serve the trials it can (default: a fresh process each, "
                         "as a training run starts)")
    ap.add_argument("--allocator", choices=["plan", *ALLOCATORS], default="plan",
                    help="PyTorch's allocator setting for the runner: the plan's (its "
                         "provenance.allocator, where recorded), expandable segments, or PyTorch's "
                         "default")
    ap.add_argument("runner", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = args.runner[1:] if args.runner[:1] == ["--"] else args.runner
    if not argv:
        ap.error("give the trial runner after --")
    with open(args.plan) as f:
        plan = json.load(f)
    if args.max_micro_batch is None:
        args.max_micro_batch = 4096
        if args.profile:
            with open(args.profile) as f:
                args.max_micro_batch = json.load(f)["space"]["max_micro_batch"]
    budget, device = plan["budget"], plan["device"]
    usable = lambda b: None if b is None else b * (1 - budget["headroom"])  # noqa: E731
    gpu_usable, host_usable = usable(budget["gpu_bytes"]), usable(budget["host_bytes"])
    first = plan["evidence"][0]["request"]
    knobs = dict(plan["knobs"])

    def request(mb: int) -> dict:
        return {"protocol": 1, "model": plan["model"], "knobs": dict(knobs, micro_batch=mb),
                "warmup_steps": first["warmup_steps"], "timed_steps": first["timed_steps"],
                "device": device["kind"], "gpu_capacity_bytes": device["gpu_memory_bytes"],
                "host_budget_bytes": device["host_memory_bytes"]}

    log = open(args.log, "a") if args.log else sys.stderr
    allocator = (plan.get("provenance") or {}).get("allocator") if args.allocator == "plan" \
        else ALLOCATORS[args.allocator]
    runner = Runner(argv, log, fresh=not args.reuse_runner, allocator=allocator)
    trials: dict[int, dict] = {}
    started = time.monotonic()
    out_of_time = False

    def measure(mb: int) -> dict:
        nonlocal out_of_time
        if mb not in trials:
            if args.total_timeout and time.monotonic() - started > args.total_timeout:
                out_of_time = True
                return {"outcome": "not_run"}
            t0 = time.monotonic()
            reply = runner.ask(request(mb), args.trial_timeout)
            reply["wall_s"] = round(time.monotonic() - t0, 3)
            trials[mb] = reply
            peak = reply.get("peak_gpu_bytes")
            print(f"harness_exact.py: mb {mb}: {reply.get('outcome')}"
                  f"{'' if peak is None else f', peak {peak / 2**30:.2f} GiB'}", file=sys.stderr, flush=True)
        return trials[mb]

    def runs(mb: int) -> bool:
        return measure(mb).get("outcome") == "fits"

    def feasible(mb: int) -> bool:
        r = measure(mb)
        return (r.get("outcome") == "fits"
                and (gpu_usable is None or r["peak_gpu_bytes"] <= gpu_usable)
                and (host_usable is None or r["peak_host_bytes"] <= host_usable))

    def boundary(ok, start: int):
        """The largest micro-batch where ``ok`` holds, assuming it holds below and not above."""
        lo, hi = 0, None
        b = max(1, start)
        while not out_of_time:
            if ok(b):
                lo = b
                if b >= args.max_micro_batch:
                    break
                b = min(2 * b, args.max_micro_batch)
                if hi is not None and b >= hi:
                    break
            else:
                hi = b
                break
        if lo == 0 and hi is not None:
            # Below the start: halve down to a feasible one.
            b = hi // 2
            while b >= 1 and not out_of_time:
                if ok(b):
                    lo = b
                    break
                hi, b = b, b // 2
        while hi is not None and hi - lo > 1 and not out_of_time:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo, hi

    plan_mb = plan["knobs"]["micro_batch"]
    feasible_max, feasible_hi = boundary(feasible, plan_mb)
    runs_max, runs_hi = boundary(runs, max(feasible_max, 1))
    # Bisection assumes feasibility is monotone in the micro-batch; PyTorch's caching allocator
    # can break that (a batch fits where a smaller one fragments and fails). Every micro-batch
    # between the plan and the bisection's boundary, in order: the largest below which all fit.
    contiguous_max = None
    if args.scan and not out_of_time:
        contiguous_max = 0
        for b in range(1, feasible_max + 1):
            if b < plan_mb and b not in trials:
                continue
            if out_of_time or not feasible(b):
                break
            contiguous_max = b
    runner.stop()
    ratio = plan_mb / feasible_max if feasible_max else None
    result = {
        "model": plan["model"]["name"], "knobs": plan["knobs"], "plan_micro_batch": plan_mb,
        "allocator": allocator,
        "feasible_max": feasible_max, "first_infeasible": feasible_hi,
        "runs_max": runs_max, "first_failing": runs_hi,
        "ratio": ratio, "within_2pct": None if ratio is None else abs(1 - ratio) <= TOLERANCE,
        "contiguous_max": contiguous_max,
        "ratio_to_contiguous": plan_mb / contiguous_max if contiguous_max else None,
        "exact": not out_of_time, "budget": budget, "seconds": round(time.monotonic() - started, 1),
        "runners_started": runner.started,
        "trials": [{"micro_batch": mb, **{k: v for k, v in r.items() if k != "protocol"}}
                   for mb, r in sorted(trials.items())],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"harness_exact.py: feasible max {feasible_max} (first infeasible {feasible_hi}), runs up to "
          f"{runs_max}; plan {plan_mb}, ratio {ratio}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

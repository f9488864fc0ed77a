"""fp8_report.py, strongest_report.py and builds_report.py without a GPU (Python 3 standard library only), on
folders written here as the bench scripts would write them:

    python3 -B -m unittest discover -s benches/gpu/tests
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU = os.path.dirname(HERE)


def write_lines(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def headline(folder):
    """The folder's headline.json entries by metric."""
    with open(os.path.join(folder, "headline.json")) as f:
        return {e["metric"]: e for e in json.load(f)}


def run(script, folder):
    return subprocess.run([sys.executable, "-B", os.path.join(GPU, script), folder],
                          capture_output=True, text=True, check=True).stdout


class Fp8Report(unittest.TestCase):
    def test_the_slower_rounds_and_the_last_twenty_losses_are_compared(self):
        with tempfile.TemporaryDirectory() as d:
            write_lines(os.path.join(d, "speed.jsonl"), [
                {"precision": "bf16", "outcome": "fits", "tokens_per_s": 40000, "micro_batch": 4},
                {"precision": "fp8", "outcome": "fits", "tokens_per_s": 52000, "micro_batch": 4},
                {"precision": "bf16", "outcome": "fits", "tokens_per_s": 39000, "micro_batch": 4},
                "not json",
                {"precision": "fp8", "outcome": "fits", "tokens_per_s": 50700, "micro_batch": 4},
            ])
            # bf16 ends at 2.0, fp8 at 2.02 over the last 20 of 500 steps.
            write_lines(os.path.join(d, "loss-bf16.jsonl"),
                        [{"step": i, "loss": 5.0 if i < 480 else 2.0} for i in range(500)])
            write_lines(os.path.join(d, "loss-fp8.jsonl"),
                        [{"step": i, "loss": 9.0 if i < 480 else 2.02} for i in range(500)])
            write_lines(os.path.join(d, "loss-bf16-seed8.jsonl"),
                        [{"step": i, "loss": 2.03} for i in range(500)])
            summary = run("fp8_report.py", d)
            self.assertIn("**1.300×**", summary)
            self.assertIn("seed 8 instead of 7 ends at 2.0300: +1.50 %", summary)
            entries = headline(d)
            speed = entries["gpt-1.3b fp8 tokens/s vs bf16"]
            self.assertEqual((speed["ours"], speed["reference"], speed["ratio"]), (50700, 39000, 1.3))
            loss = entries["gpt-124m fp8 loss after 500 steps vs bf16"]
            self.assertEqual((loss["ours"], loss["reference"], loss["ratio"]), (2.02, 2.0, 1.01))

    def test_a_run_that_did_not_finish_gives_no_entry(self):
        with tempfile.TemporaryDirectory() as d:
            write_lines(os.path.join(d, "loss-bf16.jsonl"), [{"loss": 1.0}] * 500)
            write_lines(os.path.join(d, "loss-fp8.jsonl"), [{"loss": 1.0}] * 5)
            self.assertIn("did not finish", run("fp8_report.py", d))
            with open(os.path.join(d, "headline.json")) as f:
                self.assertEqual(json.load(f), [])


class StrongestReport(unittest.TestCase):
    def test_each_sides_best_batch_with_its_slower_round_is_compared(self):
        with tempfile.TemporaryDirectory() as d:
            llama = {"model": "llama-3.2-1b", "outcome": "fits"}
            write_lines(os.path.join(d, "ours-llama.jsonl"), [
                {**llama, "micro_batch": 3, "tokens_per_s": 46000, "peak_gpu_bytes": 2 ** 34},
                {**llama, "micro_batch": 3, "tokens_per_s": 45000},
                {**llama, "micro_batch": 4, "outcome": "out_of_memory"},
            ])
            write_lines(os.path.join(d, "liger-compile.jsonl"), [
                {**llama, "micro_batch": 4, "tokens_per_s": 40000},
                {**llama, "micro_batch": 6, "tokens_per_s": 41000},
                {"model": "gpt-124m", "micro_batch": 6, "outcome": "fits", "tokens_per_s": 9e9},
            ])
            gpt = {"model": "gpt-124m", "micro_batch": 16, "outcome": "fits"}
            write_lines(os.path.join(d, "gpt-124m", "autotune.jsonl"),
                        [{**gpt, "tokens_per_s": 330000}, {**gpt, "micro_batch": 512, "model": "seed",
                                                            "tokens_per_s": 1e6}])
            write_lines(os.path.join(d, "gpt-124m", "pytorch-compile.jsonl"), [{**gpt, "tokens_per_s": 300000}])
            summary = run("strongest_report.py", d)
            # 45,000 (the slower round of mb 3) against Liger's best, 41,000 at mb 6.
            self.assertIn("autotune 45,000 tokens/s (mb 3), transformers+liger+compile 41,000 (mb 6): "
                          "**1.098×**", summary)
            self.assertIn("| autotune | 4 | out_of_memory | - | - |", summary)
            # Only gpt-124m's rows count in its section.
            self.assertIn("**1.100×**", summary)
            entries = headline(d)
            liger = entries["llama-3.2-1b tokens/s vs transformers + torch.compile + Liger"]
            self.assertEqual((liger["ours"], liger["reference"], liger["ratio"]), (45000, 41000, 1.098))
            self.assertEqual(entries["gpt-124m b16 tokens/s vs torch.compile"]["ratio"], 1.1)

    def test_a_recomputing_reference_is_its_own_setting_and_can_be_the_best(self):
        with tempfile.TemporaryDirectory() as d:
            llama = {"model": "llama-3.2-1b", "outcome": "fits"}
            write_lines(os.path.join(d, "ours-llama.jsonl"), [{**llama, "micro_batch": 3, "tokens_per_s": 45000}])
            write_lines(os.path.join(d, "liger-compile.jsonl"), [
                {**llama, "micro_batch": 4, "checkpointing": False, "tokens_per_s": 20000},
            ])
            write_lines(os.path.join(d, "liger-compile-recompute.jsonl"), [
                {**llama, "micro_batch": 4, "checkpointing": True, "tokens_per_s": 30000},
                {**llama, "micro_batch": 8, "checkpointing": True, "outcome": "out_of_memory"},
            ])
            summary = run("strongest_report.py", d)
            # Batch 4 with and without recompute are two rows, not one round of the other.
            self.assertIn("| transformers+liger+compile | 4 | fits | 20,000 |", summary)
            self.assertIn("| transformers+liger+compile | 4 (recompute) | fits | 30,000 |", summary)
            self.assertIn("| transformers+liger+compile | 8 (recompute) | out_of_memory |", summary)
            self.assertIn("transformers+liger+compile 30,000 (mb 4 (recompute)): **1.500×**", summary)
            liger = headline(d)["llama-3.2-1b tokens/s vs transformers + torch.compile + Liger"]
            self.assertEqual((liger["reference"], liger["ratio"]), (30000, 1.5))
            self.assertIn("(4 (recompute); ours 3)", liger["reference_is"])


if __name__ == "__main__":
    unittest.main()


def run_builds(folder, *builds):
    return subprocess.run([sys.executable, "-B", os.path.join(GPU, "builds_report.py"), folder,
                           *builds], capture_output=True, text=True, check=True).stdout


def probe(build, row, rnd, tps, outcome="fits", peak=20 * 2**30):
    return {"build": build, "row": row, "round": rnd, "outcome": outcome, "tokens_per_s": tps,
            "peak_gpu_bytes": peak}


class BuildsReport(unittest.TestCase):
    def test_each_build_is_read_against_the_baselines_slower_round(self):
        with tempfile.TemporaryDirectory() as d:
            row = "gpt-1.3b:bf16:4"
            write_lines(os.path.join(d, "probes.jsonl"), [
                probe("main", row, 1, 40000), probe("trial", row, 1, 43000),
                "not json", probe("main", row, 2, 41000), probe("trial", row, 2, 42000),
            ])
            summary = run_builds(d, "main", "trial")
            # Slower rounds: 40,000 and 42,000, so the trial is 1.050x.
            self.assertIn("| gpt-1.3b:bf16:4 | trial | 43,000 / 42,000 | 42,000 | 1.050× |", summary)
            self.assertIn("| gpt-1.3b:bf16:4 | main | 40,000 / 41,000 | 40,000 | 1.000× |", summary)

    def test_a_round_that_did_not_fit_leaves_no_ratio(self):
        with tempfile.TemporaryDirectory() as d:
            row = "llama-3.2-1b:bf16:3"
            write_lines(os.path.join(d, "probes.jsonl"), [
                probe("main", row, 1, 45000), probe("trial", row, 1, None, outcome="oom"),
                probe("main", row, 2, 45500), probe("trial", row, 2, 47000),
            ])
            summary = run_builds(d, "main", "trial")
            self.assertIn("| llama-3.2-1b:bf16:3 | trial | oom / 47,000 | - | - |", summary)

    def test_the_tests_result_and_failures_come_first(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "tests.txt"), "w") as f:
                f.write("test cuda_attention::a ... ok\ntest cuda_ops::b ... FAILED\n"
                        "test result: FAILED. 1 passed; 1 failed\ntests exit 101\n")
            summary = run_builds(d, "main")
            self.assertIn("Tests: test result: FAILED. 1 passed; 1 failed (exit 101)", summary)
            self.assertIn("Failed: `cuda_ops::b`", summary)
            self.assertIn("no probes", summary)

    def test_each_builds_losses_are_read_against_the_baselines_at_the_same_step(self):
        with tempfile.TemporaryDirectory() as d:
            run = "gpt-124m-bf16-b16"
            write_lines(os.path.join(d, "losses", f"main-{run}.jsonl"),
                        [{"step": 1, "loss": 10.0}, {"step": 2, "loss": 8.0}])
            write_lines(os.path.join(d, "losses", f"trial-{run}.jsonl"),
                        [{"step": 1, "loss": 10.01}, {"step": 2, "loss": 8.0}])
            write_lines(os.path.join(d, "losses", f"short-{run}.jsonl"), [{"step": 1, "loss": 10.0}])
            summary = run_builds(d, "main", "trial", "short")
            # Step 1 differs by 0.01 / 10 = 0.100 %.
            self.assertIn(f"| {run} | trial | 2 | 8.0000 | 0.100 % |", summary)
            self.assertIn(f"| {run} | main | 2 | 8.0000 | 0.000 % |", summary)
            # A run that stopped early is not compared.
            self.assertIn(f"| {run} | short | 1 | 10.0000 | not comparable |", summary)

"""The harness's protocol side, without PyTorch (Python 3 standard library only):

    python3 -m unittest discover -s harness/tests

Requests are read into knobs, replies are single protocol lines, and a runner without torch
answers every trial as unsupported, saying why, instead of dying.
"""

import io
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.dont_write_bytecode = True

from autotune_harness import protocol, serve  # noqa: E402

SPEC = {"name": "tiny", "vocab_size": 256, "d_model": 64, "n_heads": 4, "n_layers": 2,
        "d_ff": 256, "seq_len": 64}


def request(id=None, **knobs):
    base = {"micro_batch": 8, "grad_accum": 2, "precision": "bf16",
            "checkpointing": {"mode": "every_kth", "k": 2}, "offload": "optimizer"}
    base.update(knobs)
    message = {"protocol": 1, "model": SPEC, "knobs": base, "warmup_steps": 1, "timed_steps": 3,
               "device": "cuda", "gpu_capacity_bytes": 1 << 34, "host_budget_bytes": 1 << 35}
    if id is not None:
        message["id"] = id
    return message


class Stdin(io.StringIO):
    def isatty(self):
        return False


class ProtocolTest(unittest.TestCase):
    def test_a_request_is_read_into_its_knobs_and_limits(self):
        r = protocol.Request(request())
        k = r.knobs
        self.assertEqual((k.micro_batch, k.grad_accum, k.precision), (8, 2, "bf16"))
        self.assertEqual(k.checkpoint_every, 2)
        self.assertTrue(k.offload)
        self.assertFalse(k.update_in_backward)
        self.assertEqual((r.seq_len, r.gpu_capacity_bytes), (64, 1 << 34))
        self.assertEqual(k.describe(), "mb=8 accum=2 bf16 ckpt=every-2 offload=optimizer")
        plain = protocol.Request(request(checkpointing={"mode": "none"}, offload="none",
                                         update="in_backward")).knobs
        self.assertIsNone(plain.checkpoint_every)
        self.assertTrue(plain.update_in_backward)
        with self.assertRaises(ValueError):
            protocol.Knobs(request(precision="fp8")["knobs"])
        with self.assertRaises(ValueError):
            protocol.Knobs(request(checkpointing={"mode": "every_kth", "k": 0})["knobs"])

    def test_replies_are_one_protocol_line_each(self):
        out = io.StringIO()
        r = protocol.Replier("pytorch", "2.11.0", out)
        r.device = "NVIDIA H200"
        r.fits([0.2, 0.1], 123, 456)
        r.out_of_memory("gpu", "eval", reusable=False)
        r.error("x" * 5000)
        r.answering(request(id=41))
        r.error("late")
        lines = out.getvalue().splitlines()
        self.assertEqual(len(lines), 4)
        fits, oom, error, answered = (json.loads(line) for line in lines)
        # Protocol 2 echoes the request's id; a request without one is answered in protocol 1.
        self.assertEqual((answered["protocol"], answered["id"]), (2, 41))
        self.assertEqual(fits, {"protocol": 1, "outcome": "fits", "engine": "pytorch",
                                "reusable": True, "engine_version": "2.11.0",
                                "device": "NVIDIA H200", "step_times_s": [0.2, 0.1],
                                "peak_gpu_bytes": 123, "peak_host_bytes": 456})
        self.assertEqual((oom["memory"], oom["phase"], oom["reusable"]), ("gpu", "eval", False))
        self.assertEqual(len(error["reason"]), 1000)
        with self.assertRaises(AssertionError):
            r.out_of_memory("disk", "eval")

    def test_without_torch_every_trial_is_unsupported_saying_why(self):
        saved = sys.modules.get("torch")
        sys.modules["torch"] = None  # `import torch` now raises ImportError
        try:
            lines = "".join(json.dumps(request(id=b, micro_batch=b)) + "\n" for b in (1, 2))
            stdin, stdout = Stdin(lines + "not json\n"), io.StringIO()
            code = serve(lambda spec: None, lambda *a: None, stdin=stdin, stdout=stdout)
        finally:
            if saved is None:
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = saved
        self.assertEqual(code, 0)
        replies = [json.loads(line) for line in stdout.getvalue().splitlines()]
        self.assertEqual(len(replies), 3)
        self.assertEqual([r.get("id") for r in replies], [1, 2, None])
        for reply in replies:
            self.assertEqual(reply["outcome"], "unsupported")
            self.assertIn("PyTorch is not importable", reply["reason"])
            self.assertTrue(reply["reusable"])


if __name__ == "__main__":
    unittest.main()

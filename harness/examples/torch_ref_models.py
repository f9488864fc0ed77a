"""The models of autotune's presets in PyTorch, for the example runners: the code of
benches/gpu/torch_ref.py (the eager reference autotune's GPU benchmarks compare against), built
from the model spec a trial request carries, and random-token batches as that reference uses.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.dont_write_bytecode = True  # importing must not leave __pycache__ in the checkout

import torch  # noqa: E402


def _load_torch_ref():
    """benches/gpu/torch_ref.py, loaded by its path: putting benches/gpu on the import path
    would let its scripts shadow installed packages (its kernels.py, Hugging Face's kernels)."""
    path = os.path.join(HERE, "..", "..", "benches", "gpu", "torch_ref.py")
    spec = importlib.util.spec_from_file_location("torch_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_ref"] = module
    spec.loader.exec_module(module)
    return module


torch_ref = _load_torch_ref()

from autotune_harness import Unsupported  # noqa: E402

# What each model class is: the spec fields it cannot change.
SHAPES = {
    "gpt": {"causal": True, "norm": "pre", "activation": "gelu", "positions": "learned", "dropout": 0.0},
    "seed": {"causal": False, "norm": "post", "activation": "relu", "positions": "none", "dropout": 0.1},
}


class SpecMismatch(Unsupported):
    """The spec asks for a model this class does not build."""


def preset(spec: dict, kind: str) -> "torch_ref.Preset":
    """torch_ref's preset for ``spec``, if the ``kind`` of model can be it."""
    for field, value in SHAPES[kind].items():
        got = spec.get(field)
        if (abs(got - value) > 1e-9) if isinstance(value, float) else got != value:
            raise SpecMismatch(f"this runner builds {kind} models ({field} {value!r}); the spec "
                               f"{spec.get('name')!r} has {field} {got!r}")
    return torch_ref.Preset(spec["name"], kind, spec["vocab_size"], spec["d_model"],
                            spec["n_heads"], spec["n_layers"], spec["d_ff"], spec["seq_len"], 0.0)


def random_tokens(spec: dict, micro_batch: int, device, generator):
    """Uniform random input and target tokens, made on the device (not timed)."""
    shape = (micro_batch, spec["seq_len"])
    inputs = torch.randint(0, spec["vocab_size"], shape, device=device, generator=generator)
    targets = torch.randint(0, spec["vocab_size"], shape, device=device, generator=generator)
    return inputs, targets

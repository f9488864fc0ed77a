#!/usr/bin/env python3
"""Trial runner for autotune's seed model in PyTorch: the tutorial's encoder of
benches/gpu/torch_ref.py (nn.Embedding, 6 x nn.TransformerEncoderLayer(512, 8), nn.Linear), its
encoder layers checkpointed when asked.

    autotune tune --model seed --target rtx4090-32g --backend exec -- \\
        python3 harness/examples/seed_runner.py
"""

import sys

from torch_ref_models import preset, random_tokens, torch_ref

from autotune_harness import serve


def build_model(spec):
    return torch_ref.SeedModel(preset(spec, "seed"))


if __name__ == "__main__":
    sys.exit(serve(build_model, random_tokens, blocks=lambda model: model.encoder.layers))

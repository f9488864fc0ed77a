#!/usr/bin/env python3
"""Trial runner for autotune's GPT presets (gpt-124m, gpt-350m, gpt-1.3b, gpt-2b, tiny) in
PyTorch: the decoder of benches/gpu/torch_ref.py (SDPA attention, pre-norm blocks), its blocks
checkpointed when asked.

    autotune tune --model gpt-124m --target rtx4090-32g --backend exec -- \\
        python3 harness/examples/gpt_runner.py
"""

import sys

from torch_ref_models import preset, random_tokens, torch_ref

from autotune_harness import serve


def build_model(spec):
    return torch_ref.GptModel(preset(spec, "gpt"))


if __name__ == "__main__":
    sys.exit(serve(build_model, random_tokens, blocks=lambda model: model.blocks))

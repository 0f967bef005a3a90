"""The deterministic state stored in tests/fixtures/format_v1 (do not change it)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


def golden_state() -> dict[str, Any]:
    w = torch.arange(3000, dtype=torch.float32).reshape(30, 100) / 7
    return {
        "model": OrderedDict(
            [("w", w), ("w_t", w.t()), ("b", torch.linspace(-1, 1, 100).to(torch.bfloat16))]
        ),
        "ints": torch.arange(1000, dtype=torch.int64)[::3],
        "mask": torch.arange(64) % 3 == 0,
        "half": torch.full((5,), 0.5, dtype=torch.float16),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "meta": {
            "step": 42,
            "big": 2**80,
            "lrs": [0.1, float("inf"), float("nan")],
            (1, "k"): (b"\x00\x01", None, True),
            "shape": torch.Size([2, 3]),
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
        },
    }

"""The deterministic state the kill tests save: a pure function of (seed, step).

Frozen weights depend on the seed only, so every save after the first deduplicates them;
adapter ``i`` changes every ``i + 1`` steps, so consecutive saves share some trainable
tensors too. Several dtypes (fp32, bf16, fp16, int64) make "bit-exact" mean something.
"""

from __future__ import annotations

import hashlib
from typing import cast

import torch
from torch import nn

ADAPTERS = 4
WIDTH = 256


def _generator(*parts: int) -> torch.Generator:
    # Mixed into one 63-bit seed so (seed, 1, 2) and (seed, 12) never collide.
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class StressNet(nn.Module):
    """About 2.6 MiB: a frozen fp32 embedding and bf16 projection, fp32 adapters, buffers."""

    def __init__(self, seed: int, step: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 512)
        self.base = nn.Linear(512, 512, bias=False, dtype=torch.bfloat16)
        self.adapters = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(ADAPTERS))
        self.register_buffer("step", torch.tensor([step], dtype=torch.int64))
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.empty(WIDTH, dtype=torch.float16))
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(512, 512, generator=_generator(seed, 0)))
            self.base.weight.copy_(torch.randn(512, 512, generator=_generator(seed, 1)).to(torch.bfloat16))
            for index, module in enumerate(self.adapters):
                adapter = cast(nn.Linear, module)
                epoch = step // (index + 1)
                adapter.weight.copy_(torch.randn(WIDTH, WIDTH, generator=_generator(seed, 2, index, epoch)))
                adapter.bias.copy_(torch.randn(WIDTH, generator=_generator(seed, 3, index, epoch)))
            self.scale.copy_(torch.rand(WIDTH, generator=_generator(seed, 4, step)).to(torch.float16))
        self.embed.weight.requires_grad_(False)
        self.base.weight.requires_grad_(False)


def state_sha(state: dict[str, torch.Tensor]) -> str:
    """A hash of names, dtypes, shapes and bytes: equal hashes mean bit-identical states."""
    hasher = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        hasher.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def expected_state(seed: int, step: int) -> dict[str, torch.Tensor]:
    """The state_dict saved at ``step``."""
    return dict(StressNet(seed, step).state_dict())

"""What the bit-exact runtime tests compare: seeded token ids, and two hybrid caches' states."""

from __future__ import annotations

import torch


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` token ids below 700 (the tiny models' vocabulary), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 700, (n,), generator=g)]


def same_state(a, b) -> bool:
    """Whether two caches hold the same tokens' state bit for bit: conv windows, recurrent states, K/V so far."""
    if a.n != b.n:
        return False
    lin = all(torch.equal(a.conv[i], b.conv[i]) and torch.equal(a.state[i], b.state[i]) for i in a.conv)
    return lin and all(torch.equal(a.keys[i][:, :a.n], b.keys[i][:, :b.n]) and
                       torch.equal(a.values[i][:, :a.n], b.values[i][:, :b.n]) for i in a.keys)

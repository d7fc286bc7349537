"""A shuffle of [0, n) that is never stored: a keyed Feistel network, evaluated on the positions one asks for.

`FeistelPermutation(n, seed, epoch)[positions]` is the value at those positions of one fixed permutation of
[0, n), chosen by (seed, epoch): a bijection, computed in a few vectorised numpy calls per array of positions,
with no state beyond 8 round keys. Building one is O(1) in n, so an epoch of a billion samples starts at once,
and a rank computes only the positions of its own slice of each global batch.

The network works on 2h bits, the smallest even width with 2^2h >= n (at most 4n values): each round mixes one
half with a keyed integer finaliser of the other. Values that land in [n, 2^2h) are walked on through the network
until they fall back into range ("cycle-walking", Black and Rogaway 2002): each value's cycle under the network
contains the in-range start, so the walk ends, and the map stays a bijection of [0, n). Since 2^2h < 4n, a walk
takes fewer than 4 passes on average. See docs/data-order.md for the number of rounds and the measured quality.
"""

from __future__ import annotations

import numpy as np

#: Feistel rounds: twice Luby-Rackoff's 4 (a strong pseudorandom permutation), above Patarin's 6 (docs/data-order.md).
ROUNDS = 8
#: Up to 2^62 values: positions arrive as int64 and the two halves of at most 31 bits stay well inside uint64.
MAX_SIZE = 2**62

_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads the round number over the key


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Stafford's Mix13) on uint64 arrays: every input bit flips each output bit with
    probability ~1/2. numpy's uint64 products wrap modulo 2^64, which is the arithmetic the constants assume."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """One permutation of [0, n), keyed by (seed, epoch); index it with an int array of positions."""

    def __init__(self, n: int, seed: int, epoch: int, rounds: int = ROUNDS) -> None:
        if not 1 <= n <= MAX_SIZE:
            raise ValueError(f"a permutation needs 1 <= n <= 2^62, got {n}")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        # SeedSequence hashes (seed, epoch) into independent-looking words: neighbouring seeds or epochs give
        # unrelated round keys (a plain seed + epoch, as torch.randperm was seeded, would make (s, e+1) == (s+1, e)).
        words = np.random.SeedSequence([seed % 2**64, epoch]).generate_state(rounds, dtype=np.uint64)
        self.round_keys = list(mix64(words ^ (_GOLDEN * np.arange(1, rounds + 1, dtype=np.uint64))))

    def _network(self, x: np.ndarray) -> np.ndarray:
        """The Feistel network on uint64 values below 2^(2h): a bijection of [0, 2^2h)."""
        h, mask = np.uint64(self.half_bits), self.mask
        left, right = x >> h, x & mask
        for key in self.round_keys:
            left, right = right, left ^ (mix64(right ^ key) & mask)
        return (left << h) | right

    def __getitem__(self, positions: np.ndarray | int) -> np.ndarray:
        """The permuted values at `positions` (ints in [0, n)), as int64, in the same shape."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        values = self._network(positions.astype(np.uint64).ravel())
        outside = np.flatnonzero(values >= np.uint64(self.n))
        while outside.size:  # cycle-walking, on the ever fewer values still out of range
            walked = self._network(values[outside])
            values[outside] = walked
            outside = outside[walked >= np.uint64(self.n)]
        return values.astype(np.int64).reshape(positions.shape)

"""The lazy shuffle behind the training order: an exact permutation of [0, n), as uniform as torch.randperm.

Every statistic is computed for three shuffles side by side: the Feistel permutation the sampler uses,
torch.randperm (the reference it replaces), and the same network cut down to 2 rounds, which each test must
reject: a test that passes a visibly weak shuffle would prove nothing. All seeds are fixed: the p-values are
the same on every run, and a threshold of 1e-3 keeps a sound shuffle clear of it.
"""

from collections.abc import Callable

import numpy as np
import pytest
import torch

from scaleup.data.permutation import MAX_SIZE, ROUNDS, FeistelPermutation

Shuffle = Callable[[int, int, int], np.ndarray]  # (n, seed, epoch) -> a whole permutation of [0, n)


def feistel(rounds: int) -> Shuffle:
    return lambda n, seed, epoch: FeistelPermutation(n, seed, epoch, rounds)[np.arange(n)]


def randperm(n: int, seed: int, epoch: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).numpy()


SOUND = {"feistel": feistel(ROUNDS), "torch.randperm": randperm}
WEAK = feistel(2)
SIGNIFICANCE = 1e-3


def chi_square_p(counts: np.ndarray, dof: int) -> float:
    """The p-value of counts that should all equal their mean."""
    from scipy.stats import chi2  # here: only these tests need SciPy, and importing it costs every test process

    expected = counts.mean()
    return float(chi2.sf(((counts - expected) ** 2 / expected).sum(), dof))


def joint_uniformity_p(x: np.ndarray, y: np.ndarray, n: int, bins: int = 16) -> float:
    """Pairs (x[k], y[k]) of values in [0, n), binned 16 x 16: do they fall in every cell equally often? x and y
    each take every value at most once, so the table's row and column sums are fixed: (bins - 1)^2 degrees of
    freedom, as in a test of independence."""
    counts = np.zeros((bins, bins))
    np.add.at(counts, (x * bins // n, y * bins // n), 1)
    return chi_square_p(counts, (bins - 1) ** 2)


@pytest.mark.parametrize(
    "n",
    [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 97, 127, 128, 129, 1000, 1021, 1024, 4097, 65521, 65536, 65537, 999_983, 10**6],
)
def test_every_index_exactly_once(n):
    """Primes, powers of two and their neighbours: the cycle-walk brings every value back into [0, n) once."""
    values = FeistelPermutation(n, seed=7, epoch=3)[np.arange(n)]
    assert values.dtype == np.int64
    assert np.array_equal(np.sort(values), np.arange(n))
    assert n < 8 or not np.array_equal(values, np.arange(n))


@pytest.mark.parametrize("n", [2**40, 10**12 + 39, MAX_SIZE])
def test_huge_domains_stay_in_range_without_collisions(n):
    """Beyond what can be enumerated: 30 000 positions from the start, the middle and the end of the epoch."""
    positions = np.concatenate([np.arange(10_000), np.arange(n // 2, n // 2 + 10_000), np.arange(n - 10_000, n)])
    values = FeistelPermutation(n, seed=1, epoch=0)[positions]
    assert values.min() >= 0 and values.max() < n
    assert len(np.unique(values)) == len(values)
    assert values.max() > n // 2  # spread over the domain, not stuck in its low values


def test_the_order_depends_on_seed_and_epoch_only():
    def order(seed: int, epoch: int) -> np.ndarray:
        return FeistelPermutation(1000, seed, epoch)[np.arange(1000)]

    assert np.array_equal(order(5, 2), order(5, 2))
    orders = [order(5, 2), order(5, 3), order(6, 2), order(4, 3), order(-1, 2)]
    # (seed, epoch + 1) and (seed + 1, epoch) differ too: the key is not seed + epoch.
    assert len({o.tobytes() for o in orders}) == len(orders)


def test_positions_out_of_range_are_refused():
    with pytest.raises(IndexError, match=r"positions must lie in \[0, 10\)"):
        FeistelPermutation(10, 0, 0)[np.array([3, 10])]
    with pytest.raises(ValueError, match="1 <= n <= 2"):
        FeistelPermutation(0, 0, 0)


def index_positions_p(shuffle: Shuffle, n: int = 48, seeds: int = 1600) -> float:
    """Over many seeds, each index should take each position equally often: one chi-square test of the n x n
    table of (index, position) counts, whose rows and columns each sum to the number of seeds. n = 48 walks
    (the network covers 64 values)."""
    counts = np.zeros((n, n))
    for seed in range(seeds):
        counts[shuffle(n, seed, 0), np.arange(n)] += 1
    return chi_square_p(counts, (n - 1) ** 2)


@pytest.mark.parametrize("name", SOUND)
def test_every_index_lands_anywhere_with_equal_odds(name):
    assert index_positions_p(SOUND[name]) > SIGNIFICANCE


def test_uniformity_rejects_a_two_round_network():
    assert index_positions_p(WEAK) < 1e-6


N_SERIAL = 100_003


def serial_p_values(shuffle: Shuffle) -> dict[str, float]:
    """Consecutive outputs of one epoch, the same position in two epochs, and in (seed, epoch + 1) against
    (seed + 1, epoch): each pair should be jointly uniform."""
    order, next_epoch, next_seed = (shuffle(N_SERIAL, s, e) for s, e in ((3, 0), (3, 1), (4, 0)))
    return {
        "consecutive": joint_uniformity_p(order[:-1], order[1:], N_SERIAL),
        "epochs": joint_uniformity_p(order, next_epoch, N_SERIAL),
        "seed and epoch": joint_uniformity_p(shuffle(N_SERIAL, 3, 1), next_seed, N_SERIAL),
    }


@pytest.mark.parametrize("name", SOUND)
def test_no_correlation_between_consecutive_outputs_or_epochs(name):
    order, other_epoch = SOUND[name](N_SERIAL, 3, 0), SOUND[name](N_SERIAL, 3, 1)
    bound = 4 / np.sqrt(N_SERIAL)  # 4 standard errors of a correlation between independent uniforms
    assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < bound
    assert abs(np.corrcoef(order, other_epoch)[0, 1]) < bound
    assert min(serial_p_values(SOUND[name]).values()) > SIGNIFICANCE


def test_serial_tests_reject_a_two_round_network():
    assert serial_p_values(WEAK)["consecutive"] < 1e-4


def worst_avalanche_bias(rounds: int, bits: int = 20, seeds: int = 32, samples: int = 2048) -> float:
    """Flip one input bit: each output bit should flip with probability 1/2. The largest deviation over all
    (input bit, output bit) pairs, on n = 2^20, where the network covers [0, n) exactly and nothing walks."""
    rng, n = np.random.default_rng(0), 2**bits
    flips = np.zeros((bits, bits))
    for seed in range(seeds):
        permutation = FeistelPermutation(n, seed, 0, rounds)
        x = rng.integers(0, n, samples)
        y = permutation[x]
        for bit in range(bits):
            changed = y ^ permutation[x ^ (1 << bit)]
            flips[bit] += ((changed[:, None] >> np.arange(bits)) & 1).sum(axis=0)
    return float(np.abs(flips / (seeds * samples) - 0.5).max())


def test_one_flipped_input_bit_flips_every_output_bit_half_the_time():
    """Noise alone gives a largest deviation of about 0.006 here; 2 rounds leave some output bits untouched."""
    assert worst_avalanche_bias(ROUNDS) < 0.01
    assert worst_avalanche_bias(2) > 0.4

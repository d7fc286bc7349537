"""Do the streaming libraries keep the sharded reader's order guarantees? docs/sharded-data.md#why-not-a-library.

One split of N samples (sample i stores i) in each library's own format, then, for each library, the global
batches of one epoch on several topologies with the same global batch G: 1 device, 2 and 4 devices on one node,
2 nodes x 2 devices, each with 1 or 2 loader workers per rank. Global batch k is the union of every rank's k-th
batch. Counted against the 1-device run with 1 worker:

- `same`: global batches (as sets of samples) equal to the 1-device run's, of the epoch's steps;
- `resume`: a run stopped after K steps on 2 devices and resumed from the library's own state on another
  topology: its global batches equal to the uninterrupted 2-device run's, and the samples the whole epoch
  trained on twice or not at all;
- whole shards fetched in an epoch by all nodes together (2 nodes x 2 devices), over the shard count;
- sample 7 as read back after one bit of its payload flipped in a local shard.

Each rank is simulated in this one process through the library's own code: mosaicml-streaming's `generate_work`
(what `StreamingDataset.__iter__` partitions the epoch with) for a `World` of that shape; litdata's
`StreamingDataset` iterated with its `distributed_env` set to the rank and its own `state_dict`/`load_state_dict`;
webdataset's `WebDataset` with `split_by_node` under RANK/WORLD_SIZE. The engine's `ShardWindowSampler` is the
reference. No network; a few minutes on 2 busy CPU cores, most of them spent starting the spawned loader workers.
The orders are deterministic: benchmarks/results/library_order.txt holds the output (less the libraries' progress
lines).

    python -m venv /tmp/libs && /tmp/libs/bin/pip install mosaicml-streaming litdata webdataset torch
    PYTHONPATH=engine/src /tmp/libs/bin/python benchmarks/library_order.py

The libraries are not dependencies of the project; install them in a separate environment (mosaicml-streaming
pins numpy < 2.2).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

N, SHARD, G, K, SEED = 1200, 50, 40, 10, 0  # samples, per shard, global batch, steps before the stop, seed
# (nodes, devices per node, loader workers per device)
TOPOLOGIES = [(1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2), (1, 4, 1), (2, 2, 1), (2, 2, 2)]
STOPPED_ON = (1, 2, 1)  # where the interrupted run trained its first K steps
RESUMED_ON = [(1, 1, 1), (1, 4, 1), (2, 2, 1)]
Batches = list[frozenset[int]]


def global_batches(per_rank: list[list[list[int]]]) -> Batches:
    """Step k's global batch: the union of every rank's k-th batch, while every rank has one."""
    steps = min(len(batches) for batches in per_rank)
    return [frozenset(i for batches in per_rank for i in batches[k]) for k in range(steps)]


# --- the engine ------------------------------------------------------------------------------------------------


def engine(topology: tuple[int, int, int], skip: int = 0) -> Batches:
    """The engine's order does not involve the workers: the sampler runs in each rank's main process."""
    from scaleup.data.shards.order import ShardWindowSampler

    world = topology[0] * topology[1]
    per_rank = []
    for rank in range(world):
        sampler = ShardWindowSampler(
            range(N), G, world, rank, SEED, counts=np.full(N // SHARD, SHARD), window=2, checksum="0" * 16
        )
        sampler.resume(0, skip)
        indices = list(sampler)
        per_rank.append([indices[i : i + G // world] for i in range(0, len(indices), G // world)])
    return global_batches(per_rank)


def engine_resumed(topology: tuple[int, int, int]) -> Batches:
    """The checkpoint counts steps; the resumed sampler skips them on any topology."""
    return engine(STOPPED_ON)[:K] + engine(topology, skip=K)


# --- mosaicml-streaming --------------------------------------------------------------------------------------------


def mds_write(root: Path) -> Path:
    from streaming import MDSWriter

    with MDSWriter(out=str(root / "mds"), columns={"id": "int"}, size_limit=SHARD * 12 + 16) as writer:
        for i in range(N):
            writer.write({"id": i})
    return root / "mds"


@functools.cache
def mds_dataset(path: Path):
    """One StreamingDataset per directory (the library refuses a second one on the same local directory); its
    shuffle block size as the library sets it when iteration starts."""
    from streaming import StreamingDataset

    block = max(4_000_000 // 2, 1 << 18)
    return StreamingDataset(
        local=str(path), shuffle=True, shuffle_seed=SEED, num_canonical_nodes=2, shuffle_block_size=block, batch_size=G
    )


def mds(path: Path, topology: tuple[int, int, int], sample_in_epoch: int = 0) -> Batches:
    """The sample ids `StreamingDataset.__iter__` hands each worker of each rank, batched as torch's DataLoader
    takes them (batch k of a rank from worker k mod W)."""
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    nodes, devices, workers = topology
    dataset = mds_dataset(path)
    dataset.batch_size = G // (nodes * devices)
    dataset.initial_physical_nodes = STOPPED_ON[0] if sample_in_epoch else nodes
    work = generate_work("random", dataset, World(nodes, devices, workers, 0), 0, sample_in_epoch)
    per_rank = []
    for node in range(nodes):
        for device in range(devices):
            batches = [work[node, device, k % workers, k // workers] for k in range(workers * work.shape[3])]
            per_rank.append([[int(i) for i in batch if i >= 0] for batch in batches if (batch >= 0).any()])
    return global_batches(per_rank)


def mds_resumed(path: Path, topology: tuple[int, int, int]) -> Batches:
    """`StreamingDataset.state_dict(num_samples=K x G)` records the samples taken; the resume drops them."""
    return mds(path, STOPPED_ON)[:K] + mds(path, topology, sample_in_epoch=K * G)


# --- litdata -------------------------------------------------------------------------------------------------------


def sample(i: int) -> int:
    return i


def litdata_write(root: Path) -> Path:
    from litdata import optimize

    optimize(fn=sample, inputs=list(range(N)), output_dir=str(root / "litdata"), chunk_size=SHARD, num_workers=1)
    return root / "litdata"


def litdata_rank(path: Path, topology: tuple[int, int, int], rank: int, state: dict | None = None, steps=None):
    """(the rank's batches, its loader's state) from litdata's own StreamingDataset and StreamingDataLoader."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.utilities.env import _DistributedEnv

    nodes, devices, workers = topology
    # num_canonical_nodes as for mosaicml-streaming: litdata's fresh order differs across devices with any value
    dataset = StreamingDataset(str(path), shuffle=True, seed=SEED, drop_last=True, num_canonical_nodes=2)
    dataset.distributed_env = _DistributedEnv(nodes * devices, rank, nodes)
    # One worker is read in this process (litdata counts 0 workers as 1), 2 in spawned ones.
    loader = StreamingDataLoader(dataset, batch_size=G // (nodes * devices), num_workers=workers if workers > 1 else 0)
    if state is not None:
        loader.load_state_dict(state)
    batches = []
    for batch in loader:
        batches.append([int(i) for i in batch])
        if steps is not None and len(batches) == steps:
            return batches, loader.state_dict()
    return batches, None


def litdata(path: Path, topology: tuple[int, int, int]) -> Batches:
    world = topology[0] * topology[1]
    return global_batches([litdata_rank(path, topology, rank)[0] for rank in range(world)])


def litdata_resumed(path: Path, topology: tuple[int, int, int]) -> Batches:
    """Rank 0's state after K steps of the 2-device run (each rank's loader state holds the global count)."""
    world = STOPPED_ON[0] * STOPPED_ON[1]
    first = [litdata_rank(path, STOPPED_ON, rank, steps=K) for rank in range(world)]
    state = first[0][1]
    rest = [litdata_rank(path, topology, rank, state=state)[0] for rank in range(topology[0] * topology[1])]
    return global_batches([batches for batches, _ in first]) + global_batches(rest)


# --- webdataset ----------------------------------------------------------------------------------------------------


def webdataset_write(root: Path) -> list[str]:
    import webdataset as wds

    (root / "wds").mkdir()
    with wds.ShardWriter(str(root / "wds" / "shard-%06d.tar"), maxcount=SHARD, verbose=0) as sink:
        for i in range(N):
            sink.write({"__key__": f"{i:06d}", "cls": i})
    return sorted(str(p) for p in (root / "wds").glob("*.tar"))


def webdataset(urls: list[str], topology: tuple[int, int, int]) -> Batches:
    """Shards shuffled with a fixed seed and split by node (rank): no sample buffer, whose draws differ per rank."""
    import webdataset as wds

    nodes, devices, workers = topology
    per_rank = []
    for rank in range(nodes * devices):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(nodes * devices))
        dataset = wds.WebDataset(urls, shardshuffle=len(urls), seed=SEED, nodesplitter=wds.split_by_node)
        dataset = dataset.decode().to_tuple("cls").batched(G // (nodes * devices), partial=False)
        spawn = {"num_workers": workers, "multiprocessing_context": "spawn"} if workers > 1 else {}
        loader = wds.WebLoader(dataset, batch_size=None, **spawn)
        per_rank.append([[int(i) for i in batch[0]] for batch in loader])
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    return global_batches(per_rank)


# --- whole shards fetched per epoch -------------------------------------------------------------------------------


def mds_fetches(path: Path, topology: tuple[int, int, int]) -> float:
    """Shards each node's cache downloads in an epoch (those holding a sample of its ranks), all nodes, over S."""
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    nodes, devices, workers = topology
    dataset = mds_dataset(path)
    dataset.batch_size, dataset.initial_physical_nodes = G // (nodes * devices), nodes
    work = generate_work("random", dataset, World(nodes, devices, workers, 0), 0, 0)
    ends = np.cumsum([shard.samples for shard in dataset.shards])
    touched = [set(np.searchsorted(ends, work[node][work[node] >= 0], side="right")) for node in range(nodes)]
    return sum(map(len, touched)) / len(ends)


def litdata_fetches(path: Path, topology: tuple[int, int, int]) -> float:
    """Chunks the ranks of each node read in an epoch (a node's ranks share its cache), all nodes, over S."""
    nodes, devices, _ = topology
    per_rank = [litdata_rank(path, topology, rank)[0] for rank in range(nodes * devices)]
    touched = [
        {i // SHARD for r in range(n * devices, (n + 1) * devices) for b in per_rank[r] for i in b}
        for n in range(nodes)
    ]
    return sum(map(len, touched)) / (N // SHARD)


# --- the comparison ------------------------------------------------------------------------------------------------


def same(batches: Batches, reference: Batches) -> str:
    equal = sum(a == b for a, b in zip(batches, reference, strict=False))
    return f"{equal}/{len(reference)}"


def twice_or_never(batches: Batches) -> tuple[int, int]:
    """Samples the epoch's global batches hold twice or more, and samples of the split they miss (the epoch's
    steps take all N samples here: N is a multiple of G)."""
    seen = Counter(i for batch in batches for i in batch)
    return sum(1 for count in seen.values() if count > 1), N - len(seen)


def name(topology: tuple[int, int, int]) -> str:
    nodes, devices, workers = topology
    return f"{nodes}x{devices} dev, {workers} wkr"


def flipped(path: Path, value: int) -> None:
    """Flip the lowest bit of the stored int64 `value` (sample `value`'s payload) in a shard file."""
    data = bytearray(path.read_bytes())
    data[data.index(np.int64(value).tobytes())] ^= 1
    path.write_bytes(bytes(data))


def corrupt_reads(mds_path: Path, litdata_path: Path) -> dict[str, int]:
    """Sample 7 as each library reads it after one bit of its payload flipped on local disk (MDS written with a
    sha1 per shard and read with validate_hash="sha1"; litdata stores no checksum)."""
    from litdata import StreamingDataset as LitdataDataset
    from streaming import MDSWriter, StreamingDataset

    hashed = mds_path.parent / "mds-sha1"
    with MDSWriter(out=str(hashed), columns={"id": "int"}, size_limit=SHARD * 12 + 16, hashes=["sha1"]) as writer:
        for i in range(N):
            writer.write({"id": i})
    flipped(sorted(hashed.glob("shard.*.mds"))[0], 7)
    flipped(sorted(litdata_path.glob("*.bin"))[0], 7)
    return {
        "mosaicml-streaming": StreamingDataset(local=str(hashed), validate_hash="sha1", batch_size=1)[7]["id"],
        "litdata": LitdataDataset(str(litdata_path))[7],
    }


def report(mds_path: Path, litdata_path: Path, urls: list[str]) -> None:
    libraries = {
        "engine (ShardWindowSampler)": (engine, engine_resumed),
        "mosaicml-streaming": (lambda t: mds(mds_path, t), lambda t: mds_resumed(mds_path, t)),
        "litdata": (lambda t: litdata(litdata_path, t), lambda t: litdata_resumed(litdata_path, t)),
        "webdataset": (lambda t: webdataset(urls, t), None),
    }
    print(f"{N} samples, {N // SHARD} shards of {SHARD}, global batch {G}; global batches equal to 1 device's:")
    print(f"{'':30}" + "".join(f"{name(t):>17}" for t in TOPOLOGIES[1:]))
    for library, (order, _) in libraries.items():
        reference = order(TOPOLOGIES[0])
        print(f"{library:30}" + "".join(f"{same(order(t), reference):>17}" for t in TOPOLOGIES[1:]), flush=True)
    print(
        f"\nstopped after {K} steps on {name(STOPPED_ON)} and resumed from the library's state on another topology: "
        f"global batches equal to the uninterrupted {name(STOPPED_ON)} run's, samples trained on twice or never:"
    )
    print(f"{'':30}" + "".join(f"{name(t):>28}" for t in RESUMED_ON))
    for library, (order, resumed) in libraries.items():
        if resumed is None:
            print(f"{library:30}" + f"{'no resume state':>28}" * len(RESUMED_ON))
            continue
        reference, cells = order(STOPPED_ON), []
        for topology in RESUMED_ON:
            batches = resumed(topology)
            twice, never = twice_or_never(batches)
            cells.append(f"{same(batches, reference)}, {twice} twice, {never} never")
        print(f"{library:30}" + "".join(f"{cell:>28}" for cell in cells), flush=True)
    fetches = (2, 2, 1)
    print(f"\nwhole shards fetched in an epoch, all nodes together, {name(fetches)}, as a multiple of the split:")
    print(f"{'mosaicml-streaming':30}{mds_fetches(mds_path, fetches):>17.2f}")
    print(f"{'litdata':30}{litdata_fetches(litdata_path, fetches):>17.2f}")
    print("\nsample 7 read back after one bit of its payload flipped on disk (no error raised):")
    for library, value in corrupt_reads(mds_path, litdata_path).items():
        print(f"{library:30}{value:>17}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report(mds_write(root), litdata_write(root), webdataset_write(root))

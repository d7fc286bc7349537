"""Characters of text that ships with scikit-learn (its data sets' descriptions): language modelling, no download."""

from importlib.resources import files
from typing import Any

import torch
from torch.utils.data import Dataset

from scaleup.api import GlobalBatchDataModule, split_lengths

SPLITS = ("train", "val", "test")


def bundled_text() -> str:
    """scikit-learn's `datasets/descr/*.rst`, concatenated in name order: about 40,000 characters of English."""
    descr = sorted((files("sklearn.datasets") / "descr").iterdir(), key=lambda path: path.name)
    return "".join(path.read_text(encoding="utf-8") for path in descr if path.name.endswith(".rst"))


class CharChunks(Dataset):
    """Sample i is the i-th block of `block_size` character ids and, as targets, the same block shifted by one."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        chunk = self.ids[index * self.block_size : (index + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharTextDataModule(GlobalBatchDataModule):
    """Next-character prediction on `bundled_text()`, cut into blocks of `block_size` characters.

    The splits are consecutive stretches of the text (train first, then val, then test), so no evaluated block
    has a training block on either side of it. Sizes count blocks, as counts (>= 1) or fractions (< 1).
    """

    in_memory = True

    def __init__(
        self,
        block_size: int = 64,
        val_size: float = 0.1,  # blocks: a count, or a fraction (< 1)
        test_size: float = 0.1,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.block_size, self.val_size, self.test_size = block_size, val_size, test_size
        self.text = bundled_text()
        self.vocab = sorted(set(self.text))  # from the whole text, so val and test hold no unknown character

    def draws_random_numbers(self, split: str) -> bool:
        return False  # fixed chunks of the text

    def model_settings(self) -> dict[str, Any]:
        return {"net.vocab_size": len(self.vocab), "net.block_size": self.block_size}

    def build_splits(self) -> dict[str, Dataset]:
        index = {char: i for i, char in enumerate(self.vocab)}
        ids = torch.tensor([index[char] for char in self.text], dtype=torch.long)
        lengths = split_lengths((len(ids) - 1) // self.block_size, self.val_size, self.test_size)
        splits, start = {}, 0
        for name, blocks in zip(SPLITS, lengths, strict=True):
            end = start + blocks * self.block_size
            splits[name] = CharChunks(ids[start : end + 1], self.block_size)  # +1: the last block's last target
            start = end
        return splits

"""Datasets and child targets for tests/test_device.py (at module top level:
spawn and forkserver workers import them)."""

import numpy as np
import torch
import torch.utils.data as tud

import torchshm

TIMEOUT = 120
SHAPE = (64, 1024)  # 256 KiB of float32: every batch is shared


def sample(i):
    return {"x": np.full(SHAPE, float(i), dtype=np.float32), "y": np.int64(i)}


class Samples(tud.Dataset):
    """Sample i is all i: a batch's content says which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return sample(i)


def stack(samples):
    """A NumPy collate: its batches are born shared in the worker (Note
    [Batches born shared] in torchshm/_dataloader.py)."""
    return {key: np.stack([s[key] for s in samples]) for key in samples[0]}


def expected(indices):
    """What a batch of these samples holds, as CPU tensors."""
    x = torch.stack([torch.full(SHAPE, float(i)) for i in indices])
    return {"x": x, "y": torch.tensor(indices, dtype=torch.int64)}


def wide_sample(i):
    """Two arrays above the small-block size: collate stacks both into one
    segment."""
    return {"x": sample(i)["x"], "z": np.full((32, 1024), -float(i), np.float32)}


def send_batches(inbox, outbox, rounds):
    """Sends a torchshm.collate batch of wide samples [r, r + 1] each round,
    once the parent has dropped the last (its pool reuses the segment)."""
    for r in range(rounds):
        outbox.put(torchshm.collate([wide_sample(r), wide_sample(r + 1)]))
        inbox.get(timeout=TIMEOUT)


def send_born_batch(inbox, outbox):
    """Sends one np.stack batch (born shared here), then waits."""
    with torchshm.allocating():
        batch = stack([sample(0), sample(1)])
    outbox.put(batch)
    inbox.get(timeout=TIMEOUT)

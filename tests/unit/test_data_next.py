"""The DataLoader fetch's wrapper (``_BaseDataLoaderIter.__next__``; hooks/install.py
``_PyDataNextCore``, in C ``hooks/_ctracker.c`` ``DataNext``), run with both cores: it passes for
torch's method, times the fetch as ``data_wait_s``, scans for the roots at the first fetch, tells
the exception observers of a fetch that raised (not of the epoch's end) and lets the exception go
on unchanged, with no frame of stepwatch's in its traceback from the C core."""

import time
import traceback

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py


class Slow(Dataset):
    """Each sample takes 3 ms; sample ``bad`` raises."""

    def __init__(self, n, bad=None):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        time.sleep(0.003)
        return torch.full((4,), float(i)), torch.ones(1)


def test_the_wrapper_passes_for_torchs_method_and_is_undone(sw):
    stepwatch, mem, start = sw
    orig = _BaseDataLoaderIter.__next__
    start()
    wrapped = _BaseDataLoaderIter.__next__
    assert wrapped is not orig and wrapped.__wrapped__ is orig
    assert wrapped.__name__ == "__next__" and wrapped.__qualname__ == orig.__qualname__
    it = iter(DataLoader(Slow(4), batch_size=2))
    assert it.__next__.__self__ is it  # bound to the iterator, as a function on a class is
    assert [x[0, 0].item() for x, _ in it] == [0.0, 2.0]
    stepwatch.shutdown()
    assert _BaseDataLoaderIter.__next__ is orig


def test_fetches_are_timed_and_the_first_one_finds_the_model(sw):
    """A manual-SGD loop (no optimizer, so only the first fetch scans before the first forward),
    its model built after init: step 0's forward is timed too."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    for x, y in DataLoader(Slow(8), batch_size=2):
        nn.functional.mse_loss(m(x), y).backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4
    assert all(r.forward_s > 0 for r in recs)
    assert all(r.data_wait_s >= 2 * 0.003 * 0.9 for r in recs)  # two samples of 3 ms a batch
    assert all(r.samples == 2 for r in recs)


def test_a_fetch_that_raises_is_reported_and_goes_on_unchanged(sw, both_tracker_cores):
    stepwatch, mem, start = sw
    session = start()
    told = []
    session.instrumentation.exception_observers.append(lambda phase, e: told.append((phase, type(e).__name__)))
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sample 5 is corrupt") as info:
        for x, y in DataLoader(Slow(8, bad=5), batch_size=2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert told == [("data", "ValueError")]
    assert session.tracker.in_data == 0  # the data phase was closed
    frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    if both_tracker_cores == "c":
        assert not [f for f in frames if "stepwatch" in f], frames
    # The epoch's end (StopIteration) is no failure: the observers hear nothing of it.
    told.clear()
    for x, y in DataLoader(Slow(4), batch_size=2):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert told == []
    stepwatch.shutdown()

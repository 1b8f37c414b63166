"""The FLOP count's real replay (the fallback when a forward cannot run on fake tensors: one
``.item()``, ``int(tensor)``) on models that write their own parameters in place during forward,
as real scripts do: MoCo's momentum key encoder, a running statistic kept in a frozen
``nn.Parameter``, a weight clamp under ``no_grad``. The replay ran on detached aliases of the
parameters, so each write landed in the real model once per input signature, before step 0's
real forward: the losses and the weights were not those of the same run without stepwatch. They
are bit-identical now, and the FLOPs are still counted where the parameters can be copied."""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class MoCo(nn.Module):
    """He et al. 2020's shape: a key encoder updated by momentum inside forward (its parameters
    frozen), a queue of keys, and ``int(queue_ptr)`` (data-dependent: no fake replay)."""

    def __init__(self, dim=16, K=32, m=0.9):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, dim))
        self.k = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, dim))
        for pq, pk in zip(self.q.parameters(), self.k.parameters()):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.m, self.K = m, K
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, xq, xk):
        q = F.normalize(self.q(xq), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)
            k = F.normalize(self.k(xk), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone()], 1) / 0.07
        with torch.no_grad():
            ptr = int(self.queue_ptr)
            self.queue[:, ptr:ptr + len(k)] = k.T
            self.queue_ptr[0] = (ptr + len(k)) % self.K
        return F.cross_entropy(logits, torch.zeros(len(xq), dtype=torch.long))


class FrozenRunningStat(nn.Module):
    """A running statistic kept in ``nn.Parameter(requires_grad=False)`` (so that it moves with
    ``.to()`` and lands in the checkpoint) and updated in place, plus one ``.item()``."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8), requires_grad=False)

    def forward(self, x):
        h = self.f(x)
        with torch.no_grad():
            self.scale.mul_(0.9).add_(h.detach().std(0), alpha=0.1)
        if h.abs().max().item() > 1e9:  # a guard against blow-ups, as scripts write it
            h = h * 0
        return (h * self.scale).pow(2).mean()


class ClampedInForward(nn.Module):
    """A weight constraint applied in forward (max-norm / WGAN-style clipping) under ``no_grad``,
    on a parameter that trains, plus one ``.item()``."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(8, 16)
        self.g = nn.Linear(16, 1)

    def forward(self, x):
        with torch.no_grad():
            self.f.weight.clamp_(-0.2, 0.2)
            self.g.weight.data.mul_(0.999)  # through .data, as older scripts write it
        h = self.f(x).relu()
        if not torch.isfinite(h).all().item():
            raise RuntimeError("non-finite activations")
        return self.g(h).pow(2).mean()


class EmaThroughAList(nn.Module):
    """An EMA whose pairs of parameters were listed once in ``__init__``: the forward writes the
    real parameters through the list, not through the module's attributes."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = nn.Linear(8, 8), nn.Linear(8, 8)
        self.teacher.requires_grad_(False)
        self.pairs = list(zip(self.student.parameters(), self.teacher.parameters()))

    def forward(self, x):
        with torch.no_grad():
            for ps, pt in self.pairs:
                pt.lerp_(ps, 0.1)
            t = self.teacher(x)
        s = self.student(x)
        if s.sum().item() > 1e9:
            s = s * 0
        return (s - t).pow(2).mean()


def _train(make, steps=4):
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 8, generator=g)
        if isinstance(m, MoCo):
            loss = m(x + 0.1 * torch.randn(8, 8, generator=g), x + 0.1 * torch.randn(8, 8, generator=g))
        else:
            loss = m(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same_run(plain, watched):
    (l0, s0), (l1, s1) = plain, watched
    assert [t.item() for t in l0] == [t.item() for t in l1]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert s0.keys() == s1.keys()
    assert all(torch.equal(s0[k], s1[k]) for k in s0), [k for k in s0 if not torch.equal(s0[k], s1[k])]


@pytest.mark.parametrize("make", [MoCo, FrozenRunningStat, ClampedInForward],
                         ids=["moco", "frozen_running_stat", "clamp_under_no_grad"])
def test_a_forward_that_writes_its_parameters_trains_the_same_and_is_counted(sw, make):
    stepwatch, mem, start = sw
    plain = _train(make)
    start()
    watched = _train(make)
    stepwatch.shutdown()
    _same_run(plain, watched)
    recs = [r for r in mem.records if not r.tail]
    # The parameters of these small models fit in memory twice: counted on copies of them.
    assert len(recs) == 4 and all(r.flops and r.flops > 0 for r in recs), [r.flops for r in recs]


def test_a_write_through_a_reference_the_replay_cannot_swap_is_stopped(sw, caplog):
    """The EMA's list holds the real parameters: no copy given to the replay reaches them. The
    write is stopped before it lands, and the FLOPs are null, said once."""
    stepwatch, mem, start = sw
    plain = _train(EmaThroughAList)
    start()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        watched = _train(EmaThroughAList)
        stepwatch.shutdown()
    _same_run(plain, watched)
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4 and all(r.flops is None for r in recs), [r.flops for r in recs]
    said = [r.getMessage() for r in caplog.records if "writes" in r.getMessage()]
    assert len(said) == 1 and "teacher.weight" in said[0] and "flops=" in said[0], said


def test_without_room_for_a_copy_the_count_is_refused_and_training_is_untouched(sw, caplog, monkeypatch):
    """Where a copy of the parameters does not fit (a large model on a full GPU), the replay that
    would write one is not run on copies: the FLOPs are null with one line that says why."""
    from stepwatch.metrics import flops

    monkeypatch.setattr(flops, "_free_bytes", lambda device: 0, raising=False)
    stepwatch, mem, start = sw
    plain = _train(MoCo)
    start()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        watched = _train(MoCo)
        stepwatch.shutdown()
    _same_run(plain, watched)
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4 and all(r.flops is None for r in recs), [r.flops for r in recs]
    said = [r.getMessage() for r in caplog.records if "writes" in r.getMessage()]
    assert len(said) == 1 and "k.0.weight" in said[0] and "memory" in said[0], said

"""Cost of the straggler exchange as ranks grow: 8, 64, 256 simulated ranks against one TCPStore.

    PYTHONPATH=src python benchmarks/exchange_scale.py [--ranks 8 64 256] [--windows 5] [--procs 4]

What runs: one TCPStore server (this process), and ``--procs`` worker processes that each
simulate ranks/procs ranks. Every simulated rank has its own store client (its own TCP
connection, as a real rank has) and runs only stepwatch's exchange (``StragglerExchange``):
publish its window summary, then the leader (rank 0) collects, judges and posts the verdict, and
every other rank reads it. A process steps through its ranks one after another in each window,
so 256 ranks need 4 processes, not 256 (the machine has 2 cores). Printed per rank count: store
operations per window (all ranks, per follower, for the leader), bytes the leader reads, and the
latency of a follower's publish and of the leader's collect+judge. Operations that only found
"not yet" (the leader's counter read short of all ranks, a follower's verdict check before the
verdict exists) are counted apart as empty polls: their number depends on how long the
benchmark waits between tries, not on the design; in a job there is one per pending window per
background pass (default every 0.25 s).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


class CountingStore:
    """A store client that counts operations and bytes (the real store underneath)."""

    def __init__(self, store):
        self.s = store
        self.ops = 0
        self.polls = 0  # operations that only found "not yet" (a counter read short, a missing key)
        self.bytes_in = 0

    def _c(self):
        self.ops += 1

    def append(self, k, v):
        self._c()
        return self.s.append(k, v)

    def add(self, k, n):
        self._c()
        return self.s.add(k, n)

    def poll_miss(self):
        self.ops -= 1
        self.polls += 1

    def get(self, k):
        self._c()
        v = self.s.get(k)
        self.bytes_in += len(v)
        return v

    def set(self, k, v):
        self._c()
        return self.s.set(k, v)

    def check(self, keys):
        self._c()
        ok = self.s.check(keys)
        if not ok:
            self.poll_miss()
        return ok

    def delete_key(self, k):
        self._c()
        return self.s.delete_key(k)


def worker(port, world, ranks, windows, q):
    from datetime import timedelta

    import torch.distributed as dist

    from stepwatch.comm.stragglers import StragglerDetector, StragglerExchange, Summary

    exes = {}
    for r in ranks:
        st = CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)))
        exes[r] = StragglerExchange(st, "stepwatch/bench/0/strag", r, world, f"node{r // 8}")
    pub_lat, leader_lat, follower_ops, leader_ops, leader_bytes, polls = [], [], [], [], [], []
    judge = StragglerDetector(every=10, margin=0.2, windows=3, rank=0, host="node0",
                              store_factory=lambda: None, namespace="x")
    for w in range(windows):
        before = {r: e.store.ops for r, e in exes.items()}
        before_polls = sum(e.store.polls for e in exes.values())
        for r, e in exes.items():
            s = Summary(r, 0.010 + (0.005 if r == world - 1 else 0.0), 0.016, 0.0, 0.004, e.host)
            t0 = time.perf_counter()
            e.publish(w, s)
            pub_lat.append(time.perf_counter() - t0)
        if 0 in exes:
            e = exes[0]
            b0 = e.store.bytes_in
            t0 = time.perf_counter()
            deadline = time.monotonic() + 60
            got = []
            while not got and time.monotonic() < deadline:
                got = e.collect(w)
                if not got:
                    e.store.poll_miss()  # the counter read came back short
                    time.sleep(0.001)
            for ww, sums in got:
                judge.exchange = e
                judge._judge(ww, sums)
            leader_lat.append(time.perf_counter() - t0)
            leader_bytes.append(e.store.bytes_in - b0)
        for r, e in exes.items():
            if r == 0:
                continue
            deadline = time.monotonic() + 60
            while e.read_verdict(w) is None and time.monotonic() < deadline:
                time.sleep(0.002)
        for r, e in exes.items():
            n = e.store.ops - before[r]
            (leader_ops if r == 0 else follower_ops).append(n)
        polls.append(sum(e.store.polls for e in exes.values()) - before_polls)
    q.put((pub_lat, leader_lat, follower_ops, leader_ops, leader_bytes, polls))


def bench(world, windows, procs):
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = server.port
    procs = min(procs, world)
    parts = [list(range(i, world, procs)) for i in range(procs)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(port, world, part, windows, q)) for part in parts]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    res = [q.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    wall = time.perf_counter() - t0
    pub = [x for r in res for x in r[0]]
    lead = [x for r in res for x in r[1]]
    fops = [x for r in res for x in r[2]]
    lops = [x for r in res for x in r[3]]
    lbytes = [x for r in res for x in r[4]]
    npolls = sum(x for r in res for x in r[5])
    left = server.num_keys()
    return {
        "ranks": world,
        "ops_per_window": (sum(fops) + sum(lops)) / windows,
        "ops_per_follower": statistics.mean(fops),
        "ops_leader": statistics.mean(lops),
        "leader_bytes": statistics.mean(lbytes),
        "publish_p50_ms": statistics.median(pub) * 1e3,
        "publish_p99_ms": sorted(pub)[int(0.99 * (len(pub) - 1))] * 1e3,
        "leader_ms": statistics.median(lead) * 1e3,
        "keys_left": left,
        "polls_per_window": npolls / windows,
        "wall_s": wall,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--procs", type=int, default=4)
    a = ap.parse_args()
    print(f"straggler exchange, {a.windows} windows, ranks simulated by {a.procs} processes, one TCPStore")
    print(f"{'ranks':>6} {'ops/window':>11} {'ops/rank':>9} {'leader ops':>11} {'leader B':>9} "
          f"{'publish p50 ms':>15} {'p99 ms':>7} {'leader ms':>10} {'keys left':>10} {'empty polls/window':>19}")
    for n in a.ranks:
        r = bench(n, a.windows, a.procs)
        print(f"{r['ranks']:6d} {r['ops_per_window']:11.0f} {r['ops_per_follower']:9.1f} {r['ops_leader']:11.1f} "
              f"{r['leader_bytes']:9.0f} {r['publish_p50_ms']:15.3f} {r['publish_p99_ms']:7.3f} "
              f"{r['leader_ms']:10.2f} {r['keys_left']:10d} {r['polls_per_window']:19.0f}")


if __name__ == "__main__":
    main()

"""The FLOPs/tokens collector's two hot paths: metrics/_cmetrics.c (C, as installed) and the Python
of metrics/flops.py (``_PySigCore``) and metrics/tokens.py (``_PyThroughputCore``), used where the
extension could not be built, are the same code. Seeded random calls (tensors of other shapes,
dtypes, grad flags and classes, scalars of the same value in another class, NaN, keyword arguments
in another order, nested containers, grad mode, autocast, a replay on this thread and on another)
must get the same answers, the same appended items and the same exceptions from both; and the root
call's observer loop (hooks/_ctracker.c) drops a failing observer as the Python one does."""

import math
import random
import threading

import pytest
import torch
from torch import nn

import stepwatch
from stepwatch.hooks import replay
from stepwatch.metrics import flops, tokens
from stepwatch.metrics.flops import FlopCache, FlopCount

_cmetrics = pytest.importorskip("stepwatch.metrics._cmetrics", reason="the C fast path is not built here (no C compiler)")

SEEDS = range(300)


class SubTensor(torch.Tensor):
    """A tensor subclass: not the class the descriptor holds."""


def _values(rng):
    """A pool of argument values: tensors that differ in one property each, and scalars."""
    base = torch.randn(2, 3)
    pool = [
        base, torch.randn(2, 3), torch.randn(3, 2), torch.randn(2, 3, dtype=torch.float64),
        torch.randn(2, 3, requires_grad=True), torch.randint(0, 9, (2, 3)), base.as_subclass(SubTensor),
        torch.randn(()), 1, True, 1.0, 2, "a", "b", None, math.nan, 0.5,
    ]
    return pool


def _call(rng, pool):
    """Positional and keyword arguments drawn from the pool (sometimes a nested container or a
    non-tuple, which the fast path refuses)."""
    n = rng.choice([0, 1, 1, 1, 2, 3])
    args = tuple(rng.choice(pool) for _ in range(n))
    kwargs = {}
    for k in rng.sample(["mask", "labels", "x"], rng.choice([0, 0, 1, 2])):
        kwargs[k] = rng.choice(pool)
    r = rng.random()
    if r < 0.05:
        args = list(args)  # not a tuple
    elif r < 0.1:
        args = args + ([rng.choice(pool)],)  # nested: no signature
    elif r < 0.15 and kwargs:
        kwargs = dict(reversed(list(kwargs.items())))  # the same keys, another order
    return args, kwargs


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        return ("raised", type(e).__name__)


@pytest.mark.parametrize("seed", SEEDS)
def test_c_and_python_signatures_give_the_same_answer_for_every_call(seed):
    rng = random.Random(seed)
    pool = _values(rng)
    first = _call(rng, pool)
    tf32 = rng.random() < 0.5  # a signature that keeps the TF32 switches, or one that ignores them
    c_sig = flops.CallSig.of(*first, tf32)
    py_sig = flops.PyCallSig.of(*first, tf32)
    assert (c_sig is None) == (py_sig is None)
    if c_sig is None:
        return
    assert type(c_sig).matches is _cmetrics.SigCore.matches
    for _ in range(20):
        args, kwargs = first if rng.random() < 0.3 else _call(rng, pool)
        grad = rng.random() < 0.8
        autocast = rng.random() < 0.2
        switch = rng.random() < 0.2
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            torch.backends.cuda.matmul.allow_tf32 = switch
            try:
                got = _outcome(lambda: c_sig.matches(args, kwargs))
                want = _outcome(lambda: py_sig.matches(args, kwargs))
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False
        assert got == want, (args, kwargs, grad, autocast, switch)


def test_a_signature_matches_the_same_call_and_tells_apart_what_the_key_does():
    x = torch.randn(4, 8)
    for cls in (flops.CallSig, flops.PyCallSig):
        sig = cls.of((x,), {})
        assert sig.matches((torch.randn(4, 8),), {}) is True
        assert sig.matches((torch.randn(4, 9),), {}) is False
        assert sig.matches((x.double(),), {}) is False
        assert sig.matches((x.as_subclass(SubTensor),), {}) is False
        with torch.no_grad():
            assert sig.matches((x,), {}) is False
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert sig.matches((x,), {}) is False
        kw = cls.of((x, 1), {"mask": x, "n": 2})
        assert kw.matches((x, 1), {"mask": x, "n": 2}) is True
        assert kw.matches((x, True), {"mask": x, "n": 2}) is False  # 1 and True told apart
        assert kw.matches((x, 1), {"n": 2, "mask": x}) is False  # the keys in another order
        nan = cls.of((x, math.nan), {})
        assert nan.matches((x, math.nan), {}) is False  # NaN != NaN, even the same object


def test_a_signature_without_the_tf32_switches_does_not_read_them():
    """A count the switches cannot change keeps None for them: flipping either is still a match,
    with autocast on or off; a signature that keeps them sees the flip."""
    x = torch.randn(4, 8)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                for cls in (flops.CallSig, flops.PyCallSig):
                    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
                    free, kept = cls.of((x,), {}, False), cls.of((x,), {})
                    assert free.state[2:] == (None, None) and kept.state[2:] == (False, False)
                    for mm, conv in ((True, False), (False, True)):
                        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, conv
                        assert free.matches((x,), {}) is True and kept.matches((x,), {}) is False
                    with torch.no_grad():
                        assert free.matches((x,), {}) is False  # grad mode is still compared
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_tensor_class_changed_after_a_match_is_read_anew():
    """The C comparison calls a tensor attribute's getter directly while the tensor's class is
    unchanged; a class given its own attribute (or __getattr__) afterwards is read as Python reads it."""

    class Changing(torch.Tensor):
        pass

    x = torch.randn(4, 8).as_subclass(Changing)
    sigs = [cls.of((x,), {}) for cls in (flops.CallSig, flops.PyCallSig)]
    assert [s.matches((x,), {}) for s in sigs] == [True, True]  # the C reads are cached for Changing now
    Changing.shape = property(lambda self: torch.Size([1]))
    try:
        assert [s.matches((x,), {}) for s in sigs] == [False, False]
    finally:
        del Changing.shape
    assert [s.matches((x,), {}) for s in sigs] == [True, True]
    Changing.dtype = property(lambda self: torch.float16)
    try:
        assert [s.matches((x,), {}) for s in sigs] == [False, False]
    finally:
        del Changing.dtype


def test_a_broken_descriptor_raises_the_same_in_both():
    for cls in (flops.CallSig, flops.PyCallSig):
        sig = cls.of((torch.randn(2), 3), {})
        sig.flat = (5, (int, 3))  # the tensor's descriptor is not a tuple
        with pytest.raises(TypeError):
            sig.matches((torch.randn(2), 3), {})
        del sig.keys
        with pytest.raises(AttributeError):
            sig.matches((torch.randn(2), 3), {})


def _items(col):
    step = col.take()
    if step is None:
        return None
    out = []
    for fc, counts in step.items:
        out.append((None if fc is None else fc.total, None if counts is None else (counts.samples, counts.tokens)))
    return out


def _counter(module, args, kwargs, **kw):
    tensors = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    return FlopCount(forward={"fp32": sum(t.numel() for t in tensors) + 7 * torch.is_grad_enabled()})


@pytest.mark.parametrize("seed", range(100))
def test_c_and_python_collectors_append_the_same_items(seed):
    """Both collectors see the same random forwards (model calls with token ids, masks, other
    shapes; a loss module; grad off; a replay on this thread): the same items a step."""
    rng = random.Random(seed)
    model, loss_mod = nn.Linear(6, 6), nn.MSELoss()
    pad = 0 if rng.random() < 0.3 else None
    cols = [cls(cache=FlopCache(counter=_counter), pad_token_id=pad)
            for cls in (tokens.ThroughputCollector, tokens.PyThroughputCollector)]
    assert type(cols[0]).on_forward is _cmetrics.ThroughputCore.on_forward
    assert type(cols[0]).take is _cmetrics.ThroughputCore.take and type(cols[1]).take is tokens._PyThroughputCore.take
    ids = [torch.randint(0, 5, (2, 6)), torch.randint(0, 5, (3, 6)), torch.randn(2, 6)]
    for _ in range(30):
        r = rng.random()
        if r < 0.5:
            call = (model, (rng.choice(ids),), {})
        elif r < 0.7:
            mask = torch.randint(0, 2, (2, 6))
            call = (model, (), {"input_ids": ids[0], "attention_mask": mask})
        else:
            call = (loss_mod, (torch.randn(2, 6), torch.randn(2, 6)), {})
        grad = rng.random() < 0.85
        replaying = rng.random() < 0.1
        got = []
        for col in cols:
            with torch.set_grad_enabled(grad):
                if replaying:
                    replay.set_counting(True)
                try:
                    col.on_forward(*call)
                finally:
                    if replaying:
                        replay.set_counting(False)
            got.append(_items(col) if rng.random() < 2 else None)
        assert got[0] == got[1], call
    assert cols[0]._hits.keys() == cols[1]._hits.keys()


def test_another_threads_replay_does_not_hide_this_threads_forward():
    col = tokens.ThroughputCollector(cache=FlopCache(counter=_counter))
    m, x = nn.Linear(4, 4), torch.randn(2, 4)
    col.on_forward(m, (x,), {})
    col.take()
    started, done = threading.Event(), threading.Event()

    def replaying():
        replay.set_counting(True)
        started.set()
        done.wait(10)
        replay.set_counting(False)

    t = threading.Thread(target=replaying)
    t.start()
    started.wait(10)
    try:
        col.on_forward(m, (x,), {})  # the hot path, with some thread replaying
        replay.set_counting(True)
        col.on_forward(m, (x,), {})  # this thread replays: ignored
        replay.set_counting(False)
    finally:
        done.set()
        t.join(10)
    assert _items(col) == [(8 + 7, (2, None))]


def test_the_c_cores_hold_the_python_cores_state():
    members = {n for n, v in vars(_cmetrics.SigCore).items() if type(v).__name__ == "member_descriptor"}
    assert members == set(flops._PySigCore.__slots__)
    members = {n for n, v in vars(_cmetrics.ThroughputCore).items() if type(v).__name__ == "member_descriptor"}
    assert members == set(tokens._PyThroughputCore.__slots__)
    assert flops.CallSig.__mro__[2] is _cmetrics.SigCore
    assert tokens.ThroughputCollector.__mro__[-2] is _cmetrics.ThroughputCore


@pytest.mark.parametrize("cores", ["c", "python"])
def test_a_failing_forward_observer_is_dropped_and_the_others_still_run(tmp_path, monkeypatch, cores):
    """Through a real root call (C, as installed, and the Python one): an observer raising an
    Exception is taken off and reported once; the next observer runs on that call and after; one
    added by an observer during the loop runs on that call; a KeyboardInterrupt reaches the user."""
    from stepwatch.hooks import install

    if cores == "python":
        monkeypatch.setattr(install, "_RootCall", install._PyRootCall)
    s = stepwatch.init(dir=str(tmp_path), console="off", training_metrics=False, comm=False,
                       gpu_telemetry=False, nvtx=False, memory=False, watchdog="off", capture="off", otel=False)
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        calls = []

        def broken(module, args, kwargs):
            calls.append("broken")
            raise ValueError("observer broke")

        def late(module, args, kwargs):
            calls.append("late")

        def adds(module, args, kwargs):
            calls.append("adds")
            if late not in s.hub._inst.forward_observers:
                s.hub.add_forward_observer(late)

        s.hub.add_forward_observer(adds)
        s.hub.add_forward_observer(broken)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        # First call: `adds` appends `late` to the list being walked, `broken` raises and is taken
        # off (the list is replaced; the walk goes on over the old one), `late` still runs.
        assert calls == ["adds", "broken", "late", "adds", "late", "adds", "late"]
        assert broken not in s.hub._inst.forward_observers
        assert s.pipeline.failures.counts.get("observer.test_a_failing_forward_observer_is_dropped_and_the_others_still_run.<locals>.broken") == 1

        def interrupt(module, args, kwargs):
            raise KeyboardInterrupt

        s.hub.add_forward_observer(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(2, 4))
        assert interrupt in s.hub._inst.forward_observers  # not an Exception: not ours to swallow
        s.hub.remove_forward_observer(interrupt)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    finally:
        stepwatch.shutdown()


def test_both_takes_hand_over_the_same_step_untracked_and_start_a_fresh_list():
    """take() at a step's end: None with nothing appended; else a StepThroughput of the step's
    items (its FLOPs summed lazily, as __init__ leaves it), it and its list untracked by the cyclic
    GC, and a new empty list for the next step, in C as in Python."""
    import gc

    m, x = nn.Linear(4, 4), torch.randn(2, 4)
    got = []
    for cls in (tokens.ThroughputCollector, tokens.PyThroughputCollector):
        col = cls(cache=FlopCache(counter=_counter))
        assert col.take() is None
        col.on_forward(m, (x,), {})
        col.on_forward(m, (x,), {})
        before = col._items
        step = col.take()
        assert type(step) is tokens.StepThroughput and step.items is before
        assert col._items == [] and col._items is not before and col.take() is None
        assert not gc.is_tracked(step) and not gc.is_tracked(step.items)
        assert step._flops is tokens._UNSET
        got.append((len(step.items), step.flops.total, step.micro_batches))
    assert got[0] == got[1] == (2, 2 * (8 + 7), 2)


def test_a_root_call_that_raises_takes_back_what_it_added_in_both_collectors():
    """A model call that raises (a malformed batch the loop skips) added its item before the call
    ran: the exception observer takes it back, and only it. A grad-disabled call (phase 'eval')
    or a call that added nothing leaves the step's items alone."""
    m, loss_mod, x = nn.Linear(4, 4), nn.MSELoss(), torch.randn(2, 4)
    for cls in (tokens.ThroughputCollector, tokens.PyThroughputCollector):
        col = cls(cache=FlopCache(counter=_counter))
        for _ in range(2):  # the second time on the hot path (a remembered signature)
            col.on_forward(m, (x,), {})
            col.on_forward(m, (torch.randn(2, 3),), {})  # raises in the real call
            col.on_exception("forward", RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
            assert len(col._items) == 1, cls
            col.on_forward(loss_mod, (x, x), {})
            col.on_exception("forward", RuntimeError())  # the loss module raised: its item goes
            assert len(col._items) == 1, cls
            with torch.no_grad():
                col.on_forward(m, (x,), {})  # adds nothing
            col.on_exception("eval", RuntimeError())
            col.on_exception("forward", RuntimeError())  # nothing of that call to take back
            assert len(col._items) == 1 and col.take().counts[0].samples == 2, cls


class _Transform(nn.Module):
    """No parameters: a transform (a tokenizer, a normalization) called before the model."""

    def forward(self, x):
        return x


def _counting(cls):
    """``cls`` counting the calls that leave the hot path (its ``_on_forward_full``, which both
    cores call back into)."""

    class Counting(cls):
        full = 0

        def _on_forward_full(self, module, args, kwargs):
            self.full += 1
            return super()._on_forward_full(module, args, kwargs)

    return Counting


def test_a_root_without_trainable_parameters_leaves_the_model_role_to_the_model_in_both_collectors():
    """A parameter-free root called first in every step, before the model: it took the model's
    role for good (samples and tokens from its input). The model takes it at its first call; the
    transform's call in that step counts no samples (its FLOPs stay), and from then on its calls
    take the hot path (it never again looks like a root opening the step)."""
    pre, model, loss_mod, x = _Transform(), nn.Linear(6, 6), nn.MSELoss(), torch.randn(3, 6)
    cols = [_counting(cls)(cache=FlopCache(counter=_counter))
            for cls in (tokens.ThroughputCollector, tokens.PyThroughputCollector)]
    got = [[], []]
    for _ in range(6):
        for col, steps in zip(cols, got):
            col.on_forward(pre, (x,), {})
            col.on_forward(model, (x,), {})
            col.on_forward(loss_mod, (x, x), {})
            steps.append(_items(col))
    assert got[0] == got[1]
    assert got[0] == [[(18 + 7, None), (18 + 7, (3, None)), (36 + 7, None)]] * 6
    # Three first calls, then the transform's first call as a follower; then the hot path only.
    assert [col.full for col in cols] == [4, 4]


def test_a_model_without_parameters_is_the_model_while_it_is_the_only_root_in_both_collectors():
    model, loss_mod, x = _Transform(), nn.MSELoss(), torch.randn(3, 6)
    for cls in (tokens.ThroughputCollector, tokens.PyThroughputCollector):
        col = cls(cache=FlopCache(counter=_counter))
        for _ in range(3):
            col.on_forward(model, (x,), {})
            col.on_forward(loss_mod, (x, x), {})
            assert _items(col) == [(18 + 7, (3, None)), (36 + 7, None)], cls


def test_a_new_model_after_the_last_ones_unstepped_micro_batch_has_the_step_in_both_collectors():
    """A sweep's trial (or a run before a resume) that ended within an accumulation: the last
    model's micro-batch that no step took is dropped when a new model is first called after it,
    FLOPs with samples. Two models first called in the step that the first one opened (co-teaching,
    a GAN) leave the role with the first."""
    import gc

    x, left = torch.randn(3, 6), torch.randn(2, 6)
    got = []
    classes = (tokens.ThroughputCollector, tokens.PyThroughputCollector)
    for cls, freed in [(c, f) for c in classes for f in (False, True)]:
        col = cls(cache=FlopCache(counter=_counter))
        old, new = nn.Linear(6, 6), nn.Linear(6, 6)
        col.on_forward(old, (x,), {})
        first = _items(col)
        col.on_forward(old, (left,), {})  # the trial's last micro-batch: never stepped
        if freed:
            del old
            gc.collect()
            assert col._token_root is None
        col.on_forward(new, (x,), {})
        col.on_forward(new, (x,), {})
        after = _items(col)
        a, b = nn.Linear(6, 6), nn.Linear(6, 6)
        col.on_forward(a, (x,), {})
        col.on_forward(b, (x,), {})  # a second network, first called in the step `a` opened
        both = _items(col)
        col.on_forward(a, (x,), {})
        col.on_forward(b, (x,), {})
        got.append((first, after, both, _items(col)))
    assert got[0] == got[1] == got[2] == got[3]
    first, after, both, again = got[0]
    assert first == [(18 + 7, (3, None))]
    assert after == [(18 + 7, (3, None))] * 2
    assert both == again == [(18 + 7, (3, None)), (18 + 7, None)]


def test_two_alternating_signatures_both_take_the_hot_path_in_both_collectors():
    """Two micro-batch lengths in turn (or a shared encoder on queries, then on documents): each
    root remembered only its last call's signature, so every call missed and took the full path
    (~43 Python calls: the cache key, its lookup, the signature made again). The root keeps the
    signature before its last too now: after each one's first call, both take the hot path. A
    third one in the cycle still misses (each call pushes out the one it needs next)."""
    model, loss_mod = nn.Linear(6, 6), nn.MSELoss()
    a, b, c = torch.randn(3, 6), torch.randn(5, 6), torch.randn(7, 6)
    cols = [_counting(cls)(cache=FlopCache(counter=_counter))
            for cls in (tokens.ThroughputCollector, tokens.PyThroughputCollector)]
    got = [[], []]
    for _ in range(6):
        for col, steps in zip(cols, got):
            for x in (a, b):
                col.on_forward(model, (x,), {})
                col.on_forward(loss_mod, (x, x), {})
                steps.append(_items(col))
    assert got[0] == got[1]
    assert got[0] == [[(18 + 7, (3, None)), (36 + 7, None)], [(30 + 7, (5, None)), (60 + 7, None)]] * 6
    assert [col.full for col in cols] == [4, 4]  # the first call of each signature, the model's and the loss's
    for col in cols:
        col.full = 0
        for _ in range(3):
            for x in (a, b, c):
                col.on_forward(model, (x,), {})
                col.take()
        assert col.full == 7, type(col).__mro__[1]  # all but the first a and b (still remembered)

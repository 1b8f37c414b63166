"""A hooked model saves, pickles and copies exactly as without stepwatch (issue 14): a whole-model
``torch.save``/``torch.load`` and a ``pickle`` round trip work, and neither the loaded model nor a
``copy.deepcopy`` carries stepwatch's hooks (the copy's forward is not timed by the tracker)."""

import copy
import pickle
import time

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py


class Slow(nn.Module):
    """A model whose forward takes 60 ms: its time shows up in whatever phase it is counted in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(0.06)
        return self.lin(x)


class OwnState(nn.Module):
    """A module with its own ``__getstate__`` that does not call ``super()``'s (some libraries do)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x)

    def __getstate__(self):
        return dict(self.__dict__)


def users_hook(mod, args, out):  # a user's own (picklable) hook must survive the round trip
    return None


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _stepwatch_hooks(m):
    """stepwatch's hooks on ``m``: forward hooks, or the wrapped call (``_compiled_call_impl``)."""
    hooks = [h for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]
    hooks.append(m.__dict__.get("_compiled_call_impl"))
    return [h for h in hooks if h is not None
            and (getattr(h, "__module__", None) or type(h).__module__).startswith("stepwatch")]


def test_whole_model_save_load_and_pickle_round_trip(sw, tmp_path):
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model.register_forward_hook(users_hook)
    _train(model)
    assert _stepwatch_hooks(model), "the model was not hooked: the test proves nothing"
    pre_before = model._forward_pre_hooks
    hooks_before = dict(model._forward_hooks)

    path = tmp_path / "model.pt"
    torch.save(model, path)  # the whole module, as word_language_model does
    loaded = torch.load(path, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(model))

    x = torch.randn(3, 4)
    for m in (loaded, unpickled):
        assert _stepwatch_hooks(m) == []
        assert list(m._forward_hooks.values()) == [users_hook]
        assert dict(m._forward_pre_hooks_with_kwargs) == {} and dict(m._forward_hooks_always_called) == {}
        assert torch.equal(m(x), model(x))
    # the user's module itself is untouched: same hook dicts, same hooks
    assert model._forward_pre_hooks is pre_before and dict(model._forward_hooks) == hooks_before
    _train(model, 2)
    stepwatch.shutdown()
    assert len(mem.records) == 5


def test_a_module_with_its_own_getstate_still_pickles(sw):
    stepwatch, mem, start = sw
    start()
    model = OwnState()
    _train(model)
    assert _stepwatch_hooks(model)
    back = pickle.loads(pickle.dumps(model))
    x = torch.randn(3, 4)
    assert torch.equal(back(x), model(x))
    c = copy.deepcopy(model)
    assert torch.equal(c(x), model(x))


def test_a_deepcopy_carries_no_hooks_and_is_not_timed(sw):
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = Slow()
    opt = _train(model, 2)
    twin = copy.deepcopy(model)  # an EMA / teacher copy
    assert _stepwatch_hooks(model) and _stepwatch_hooks(twin) == []
    took = []
    for _ in range(2):
        t0 = time.perf_counter()
        loss = model(torch.randn(2, 4)).sum()
        t1 = time.perf_counter()
        loss.backward()
        twin(torch.randn(2, 4))  # 60 ms in the copy: not a forward of the tracked model
        t2 = time.perf_counter()
        took.append((t1 - t0, t2 - t1))
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert len(mem.records) == 4
    for r, (own, twin_s) in zip(mem.records[-2:], took):
        # Timed through hooks it carried, the copy's call would count in the model's own call.
        assert r.forward_s <= own + twin_s, (r.forward_s, r.other_s, own, twin_s)
    # It carries none; at a step's end stepwatch looks for roots (a hooked model was copied: an
    # EMA or a teacher made after training began) and finds it, so from then on its call with
    # grad enabled is the step's forward too, as a model made before init() would be: two
    # outermost calls of 60 ms, each timed once.
    last = mem.records[-1]
    assert last.forward_s >= 0.12 * 0.95 and last.other_s < 0.03, last

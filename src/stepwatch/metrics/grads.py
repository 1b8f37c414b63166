"""Grad-norm probe: the global L2 norm of the unscaled, pre-clipping gradients, read off-thread.

Training thread (optimizer step pre-hook): ``GradNormProbe.on_optimizer_step(optimizer)`` queues
a few foreach kernels (``torch._foreach_norm``) on the device and an async device->host copy;
no ``.item()``, no synchronize. If the user called ``clip_grad_norm_`` since the last step for the
same parameters, its returned (pre-clip) norm tensor is reused instead: no extra kernel at all. A
clip of other parameters (a subset, several optimizers', several clips) scaled its grads by a
factor known on the device: the probe divides their norm by it again (``GradNormProbe._unclip``).
Background thread: ``GradNormProbe.resolve(pending)`` polls a device event and reads the value.

What the pre-hook sees, and how the value is made the unscaled norm:
- plain / DDP: ``p.grad`` (DDP has already averaged it: the local norm is the global norm);
- GradScaler, non-fused optimizer: ``scaler.step`` unscales in place before calling
  ``optimizer.step`` (or the user's ``scaler.unscale_`` did): grads are unscaled;
- GradScaler, fused optimizer (``_step_supports_amp_scaling``): ``scaler.step`` passes the scale
  as ``optimizer.grad_scale`` and the grads are still SCALED: we divide by it (None after an
  explicit ``unscale_``);
- GradScaler skipping a step (inf/NaN, non-fused): ``optimizer.step`` is never called, so the
  patched ``GradScaler.step`` probes the (non-finite) grads itself and reports the step skipped;
- sharded grads (FSDP2 ``fully_shard``: DTensor ``Shard``): the local shard's sum of squares;
  the global norm needs the sum over ranks, done on the background thread through the c10d store
  (``StoreNormExchange``), never a collective on the training stream. Replicated mesh dims
  (HSDP) are divided out so each element counts once.
"""

from __future__ import annotations

import bisect
import logging
import math
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .._log import warn_once
from ..cuda_ext import copy_to_host, event_done
from ..hooks.phases import Collector, nested_optimizer_step, untracked

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingGradNorm:
    """A norm queued on the device, not yet read. ``values`` = [sharded sum of squares,
    norm of the non-sharded grads], both unscaled; or, ``per_tensor``, each grad's norm (the probe's
    common case, ``_compute_plain``): their root sum of squares is the norm, taken where it is read
    (``resolve``, off the training thread: a few float operations there instead of one more
    reduction kernel on the training thread's side of every step)."""

    values: Any
    host: Any = None
    event: Any = None
    sharded: bool = False
    from_clip: bool = False
    skipped: bool = False
    optimizer_id: int = 0
    device: int = -1  # CUDA device of ``event``
    per_tensor: bool = False
    manual: bool = False  # taken at a backward's end in a loop without an optimizer (on_manual_update)


@dataclass(frozen=True, slots=True)
class GradNormResult:
    """``norm`` is the global L2 norm, or None while a sharded norm awaits the other ranks
    (``local`` is then what to publish through ``StoreNormExchange``)."""

    norm: float | None
    local: tuple[float, float]
    sharded: bool
    nonfinite: bool
    skipped: bool
    from_clip: bool


# ----------------------------------------------------------------------------- patches


class _TapLocal(threading.local):
    """Per-thread tap state, with class defaults: reading one never set raises no AttributeError
    inside ``getattr(..., None)`` (an exception per optimizer step otherwise)."""

    clips: Any = None  # list of _Clip: this thread's clips not yet taken by an optimizer step
    total: Any = None  # (tensor, norm_type): the last norm get_total_norm returned on this thread
    scaler_opt: Any = None
    fired = True


def _grad_mark(params: Sequence[Any]) -> Any:
    """The first grad among ``params`` (weakly) and its version, or None when none has a grad: a
    backward or ``zero_grad`` since makes a new grad or bumps the version."""
    for p in params:
        g = p.grad
        if g is not None:
            return weakref.ref(g), g._version
    return None


def _mark_holds(mark: Any) -> bool:
    """No backward or ``zero_grad`` since ``_grad_mark`` made ``mark``: its grad is alive, unchanged."""
    g = mark[0]()
    return g is not None and g._version == mark[1]


class _Clip:
    """One clip of this thread's grads, not yet taken by an optimizer step.

    ``total``: the pre-clip norm it computed; ``norm_type``: its order, None when the total came
    from elsewhere than ``get_total_norm`` (a norm of unknown order); ``max_norm``; ``params``:
    the list it clipped (None: FSDP1's clip, of its module's parameters; ``n``, ``first``,
    ``last`` as for ``params``, -1, 0, 0). ``left``: the ids of those no optimizer has taken yet
    (made when first needed), ``whole``: none taken yet; ``mark``: ``_grad_mark`` of grads it
    clipped, after the clip (no longer holding: the clip is stale).

    A ``clip_grad_value_`` (``pre`` not None) clamped each element: no factor undoes it. ``pre``
    holds each grad's L2 norm before the clamp (a 1-D tensor), ``index`` a parameter's id to its
    place there, ``total`` their norm, ``max_norm`` the clip value."""

    __slots__ = ("total", "norm_type", "max_norm", "params", "n", "first", "last", "left", "whole", "mark",
                 "pre", "index")

    def __init__(self, total: Any, norm_type: float | None, max_norm: float, params: list[Any] | None,
                 mark: Any, pre: Any = None, index: dict[int, int] | None = None) -> None:
        self.total, self.norm_type, self.max_norm, self.params, self.mark = total, norm_type, max_norm, params, mark
        self.pre, self.index = pre, index
        if params is None:
            self.n, self.first, self.last = -1, 0, 0
        else:
            self.n, self.first, self.last = len(params), id(params[0]), id(params[-1])
        self.left: set[int] | None = None
        self.whole = True

    def fresh(self) -> bool:
        return self.mark is None or _mark_holds(self.mark)


def _stands_for(orig: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A tap wrapper as torch's function to whoever reads it: its docstring, and ``__wrapped__``."""

    def mark(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__doc__ = orig.__doc__
        return wrapper

    return mark


def _param_list(parameters: Any) -> list[Any]:
    """What torch's clips accept (a tensor or an iterable of them) as a list."""
    import torch

    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


class _Tap:
    """Wraps ``clip_grad_norm_``, the two halves it calls (``get_total_norm`` and
    ``clip_grads_with_norm_``, module globals of ``torch.nn.utils.clip_grad`` that it looks up at
    each call: a ``clip_grad_norm_`` imported before install is seen through them) and
    ``GradScaler.step`` once per process (they are process-global functions); probes subscribe.
    The wrappers never change what the user's call does or returns."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs = 0
        self.originals: list[tuple[Any, str, Any, Any]] = []
        self.probes: "weakref.WeakSet[GradNormProbe]" = weakref.WeakSet()
        self.local = _TapLocal()
        # Set, for good, the first time any thread clips or steps a GradScaler: until then
        # take_clip has nothing to take and skips the thread-local reads (~540 instructions each).
        self.used = False
        # The last clip any thread made (its function's name, its max_norm or clip_value), for the
        # spike finding's action: a job that clips is not told to clip. Cleared at a first install.
        self.clipped: tuple[str, float] | None = None
        self.errors = 0
        self.fsdp1_patched = False

    def install(self, probe: "GradNormProbe") -> None:
        with self.lock:
            self.probes.add(probe)
            self.refs += 1
            if self.refs > 1:
                return
            self.clipped = None
            import torch
            import torch.nn.utils
            import torch.nn.utils.clip_grad as clip_mod

            for name, public, wrap in (
                ("clip_grad_norm_", "clip_grad_norm_", self._wrap_clip),
                ("clip_grad_value_", "clip_grad_value_", self._wrap_clip_value),
                ("_clip_grads_with_norm_", "clip_grads_with_norm_", self._wrap_clip_with_norm),
                ("_get_total_norm", "get_total_norm", self._wrap_total_norm),
            ):
                orig = getattr(clip_mod, name, None)
                if orig is None:  # torch < 2.6 has no halves: only the wrapped clip_grad_norm_ is seen
                    continue
                wrapped = wrap(orig)
                for owner, attr in ((torch.nn.utils, public), (clip_mod, name)):
                    if getattr(owner, attr, None) is orig:
                        self._patch(owner, attr, wrapped)
            scaler_cls = torch.amp.GradScaler
            self._patch(scaler_cls, "step", self._wrap_scaler_step(scaler_cls.__dict__["step"]))
        self.patch_fsdp1()

    def patch_fsdp1(self) -> bool:
        """FSDP1's own clip (a method) returns the global norm; its sharded flat grads cannot be
        told apart from replicated ones otherwise. Patched once the job has imported
        ``torch.distributed.fsdp``, never imported here: that import costs about 1 s of every
        process's start-up. Called at install, at the first forward of a root module (an FSDP1
        model is wrapped, so imported, before it runs) and when a probe first meets FSDP1's flat
        parameters (the model was found at the first backward, after its first forward: that
        step's clip went unseen). True when it wrapped the clip just now."""
        if self.fsdp1_patched:
            return False
        mod = sys.modules.get("torch.distributed.fsdp")
        fsdp1 = getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None
        if fsdp1 is None:
            return False
        with self.lock:
            if self.fsdp1_patched or not self.refs:
                return False
            self.fsdp1_patched = True
            self._patch(fsdp1, "clip_grad_norm_", self._wrap_fsdp1_clip(fsdp1.__dict__["clip_grad_norm_"]))
            return True

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self.originals.append((owner, name, orig, wrapper))
        setattr(owner, name, wrapper)

    def uninstall(self, probe: "GradNormProbe") -> None:
        with self.lock:
            self.probes.discard(probe)
            self.refs = max(0, self.refs - 1)
            if self.refs:
                return
            for owner, name, orig, wrapper in reversed(self.originals):
                now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
                # Someone wrapped over us (stepwatch's own GradScaler timer, another tool):
                # leave their wrapper in place; ours is a pass-through while nothing is installed.
                if now is wrapper:
                    setattr(owner, name, orig)
            self.originals.clear()
            self.fsdp1_patched = False

    def _fail(self, where: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("stepwatch: grad-norm tap failed in %s; training is unaffected", where)

    def before_clip(self) -> None:
        """Drop this thread's clips whose grads a backward (or zero_grad) has replaced since:
        checked before the next clip, which may scale their grads again (``record`` marks them
        anew after it)."""
        clips = self.local.clips
        if clips:
            clips[:] = [c for c in clips[-15:] if c.fresh()]

    def record(self, total: Any, norm_type: float | None, max_norm: float, params: list[Any] | None,
               pre: Any = None, index: dict[int, int] | None = None) -> None:
        """A clip just made on this thread (``params`` None: FSDP1's; ``pre``, ``index``: a value
        clip's, see ``_Clip``). One without a grad clipped nothing and is not kept."""
        mark = None if params is None else _grad_mark(params)
        if params is not None and mark is None:
            return
        self.used = True
        self.clipped = ("clip_grad_value_" if pre is not None else "clip_grad_norm_", max_norm)
        c = _Clip(total, norm_type, max_norm, params, mark, pre, index)
        clips = self.local.clips
        if not clips:
            self.local.clips = [c]
            return
        for k in clips:  # fresh before this clip (before_clip), whose grads it may have scaled again
            if k.params is not None:
                k.mark = _grad_mark([p for p in k.params if k.left is None or id(p) in k.left])
        clips[:] = [k for k in clips if k.params is None or k.mark is not None]
        clips.append(c)

    def keep(self, clips: list[_Clip]) -> None:
        """Put back clips of parameters that optimizers still to step hold."""
        now = self.local.clips
        self.local.clips = clips if now is None else clips + now

    def _wrap_clip(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        @_stands_for(orig)
        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> Any:
            parameters = _param_list(parameters)
            if tap.refs:
                tap.before_clip()
            total = orig(parameters, max_norm, norm_type, *args, **kwargs)
            try:
                if parameters and tap.refs:
                    clips = tap.local.clips
                    if clips and clips[-1].total is total:
                        # recorded by the wrapped clip_grads_with_norm_ it called: once, its order known
                        clips[-1].norm_type = float(norm_type)
                    else:
                        tap.record(total, float(norm_type), float(max_norm), parameters)
            except Exception:
                tap._fail("clip_grad_norm_")
            return total

        return clip_grad_norm_

    def _wrap_clip_value(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        @_stands_for(orig)
        def clip_grad_value_(parameters: Any, clip_value: float, *args: Any, **kwargs: Any) -> Any:
            import torch

            if not tap.refs:
                return orig(parameters, clip_value, *args, **kwargs)
            parameters = _param_list(parameters)
            pre = None
            try:
                tap.before_clip()
                with_grad = [p for p in parameters if p.grad is not None]
                if with_grad:
                    with torch.no_grad():  # the grads of a create_graph backward build no graph here
                        norms, order = _norms([p.grad for p in with_grad])
                        pre = norms, {id(with_grad[i]): k for k, i in enumerate(order)}, torch.linalg.vector_norm(norms, 2.0)
            except Exception:
                tap._fail("clip_grad_value_")
            ret = orig(parameters, clip_value, *args, **kwargs)
            if pre is not None:
                try:
                    tap.record(pre[2], 2.0, float(clip_value), parameters, pre[0], pre[1])
                except Exception:
                    tap._fail("clip_grad_value_")
            return ret

        return clip_grad_value_

    def _wrap_clip_with_norm(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        @_stands_for(orig)
        def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: Any, *args: Any, **kwargs: Any) -> Any:
            import torch

            if not tap.refs:
                return orig(parameters, max_norm, total_norm, *args, **kwargs)
            parameters = _param_list(parameters)
            tap.before_clip()
            ret = orig(parameters, max_norm, total_norm, *args, **kwargs)
            try:
                if parameters and isinstance(total_norm, torch.Tensor):
                    local = tap.local
                    last, local.total = local.total, None
                    norm_type = last[1] if last is not None and last[0] is total_norm else None
                    tap.record(total_norm, norm_type, float(max_norm), parameters)
            except Exception:
                tap._fail("clip_grads_with_norm_")
            return ret

        return clip_grads_with_norm_

    def _wrap_total_norm(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        @_stands_for(orig)
        def get_total_norm(tensors: Any, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> Any:
            total = orig(tensors, norm_type, *args, **kwargs)
            if tap.refs:
                try:
                    tap.local.total = (total, float(norm_type))  # the order of a total clipped with next
                except Exception:
                    tap._fail("get_total_norm")
            return total

        return get_total_norm

    def _wrap_fsdp1_clip(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        @_stands_for(orig)
        def clip_grad_norm_(module: Any, max_norm: float, norm_type: float = 2.0) -> Any:
            total = orig(module, max_norm, norm_type)
            try:
                if tap.refs:
                    tap.record(total, float(norm_type), float(max_norm), None)
            except Exception:
                tap._fail("FullyShardedDataParallel.clip_grad_norm_")
            return total

        return clip_grad_norm_

    def _wrap_scaler_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        tap = self

        @_stands_for(orig)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not tap.refs:
                return orig(scaler, optimizer, *args, **kwargs)
            tap.used = True
            prev = getattr(tap.local, "scaler_opt", None)
            tap.local.scaler_opt = id(optimizer)
            tap.local.fired = False
            try:
                ret = orig(scaler, optimizer, *args, **kwargs)
            finally:
                fired = getattr(tap.local, "fired", True)
                tap.local.scaler_opt = prev
            if not fired:
                try:
                    if scaler.is_enabled():
                        for probe in list(tap.probes):
                            probe._skipped_step(optimizer)
                except Exception:
                    tap._fail("GradScaler.step")
            return ret

        return step

    def take_clip(self, optimizer: Any = None) -> Any:
        """This thread's clips since its last optimizer step (a list of _Clip, or None; taken:
        ``keep`` puts back what this optimizer does not hold), and, given the ``optimizer`` now
        stepping, the mark that it stepped inside the ``GradScaler.step`` that wraps it (the step
        was not skipped)."""
        if not self.used:  # no clip and no GradScaler step yet, on any thread
            return None
        local = self.local  # _TapLocal: class defaults, plain attribute reads
        if optimizer is not None and local.scaler_opt == id(optimizer):
            local.fired = True
        c = local.clips
        if c is not None:
            local.clips = None
        return c


_TAP = _Tap()
_UNKNOWN = object()  # GradNormProbe._with_clips: the norm cannot be known (the step's is None)


# ----------------------------------------------------------------------------- math

_TORCH: Any = None


def _torch() -> Any:
    """torch, imported on first use (importing stepwatch does not import it)."""
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH



def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def _replica_factor(dt: Any) -> int:
    """How many ranks hold each element of this DTensor's local shard (Replicate mesh dims)."""
    f = 1
    mesh = dt.device_mesh
    for dim, pl in enumerate(dt.placements):
        if pl.is_replicate():
            f *= mesh.size(dim)
    return f


def _norms(tensors: list[Any]) -> tuple[Any, list[int]]:
    """Each tensor's L2 norm (a sparse one's values'), by foreach kernels grouped by device and
    dtype, as one 1-D fp32 tensor (fp64 when one is fp64 or complex128) on the first tensor's
    device, in group order; and ``order``: the index in ``tensors`` of each entry."""
    import torch

    groups: dict[tuple[Any, Any], list[tuple[int, Any]]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse:
            t = t.coalesce()._values()
        groups.setdefault((t.device, t.dtype), []).append((i, t))
    first = tensors[0].device
    norms, order = [], []
    for (_dev, dtype), its in groups.items():
        ts = [t for _, t in its]
        order.extend(i for i, _ in its)
        if dtype == torch.float32 or dtype == torch.float64 or dtype.is_complex:
            # in its own precision: torch refuses to narrow fp64 to fp32, and a complex input
            # takes no real dtype (its norm is real); stack promotes the mix to fp64
            norms.extend(torch._foreach_norm(ts, 2.0))
        else:
            norms.extend(torch._foreach_norm(ts, 2.0, dtype=torch.float32))
    return torch.stack([n.to(first) for n in norms]), order


def _local_norm(tensors: list[Any]) -> Any:
    """L2 norm of a list of tensors as one vector, with foreach kernels, as a 0-dim fp32 tensor
    (fp64 when one is fp64 or complex128) on the first tensor's device; the same arithmetic as
    ``torch.nn.utils.get_total_norm``."""
    import torch

    return torch.linalg.vector_norm(_norms(tensors)[0], 2.0)


def combine_sharded(local_by_rank: Sequence[Any]) -> float:
    """The global norm from every rank's local value.

    Each item is ``(sharded_sum_of_squares, replicated_norm)`` as ``GradNormResult.local`` gives
    it (a bare float is a sharded sum of squares). Sharded parts add up over ranks; the
    non-sharded part is the same on every rank and counts once (rank 0's).
    """
    if not local_by_rank:
        raise ValueError("local_by_rank must hold one value per rank, got none")
    total = 0.0
    rep = 0.0
    for i, item in enumerate(local_by_rank):
        if isinstance(item, (int, float)):
            sq, r = float(item), 0.0
        else:
            sq, r = float(item[0]), float(item[1])
        total += sq
        if i == 0:
            rep = r
    return math.sqrt(total + rep * rep)


# ----------------------------------------------------------------------------- probe


class GradNormProbe:
    """Queue the grad-norm in the optimizer step pre-hook; resolve it on the background thread.

    ``every``: probe one optimizer step in N (``STEPWATCH_GRAD_NORM_EVERY``); skipped GradScaler
    steps are always probed. ``on_skipped(pending)`` receives the probe of a step that
    ``GradScaler`` skipped (its ``optimizer.step`` never ran, so the pre-hook never fired).
    """

    def __init__(
        self,
        every: int = 1,
        *,
        reuse_clip: bool = True,
        on_skipped: Callable[[PendingGradNorm], None] | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.every = every
        self.reuse_clip = reuse_clip
        self.on_skipped = on_skipped
        # Keyed weakly by optimizer: a discarded optimizer (and its parameters) is not kept alive.
        # One entry per optimizer: its step count and its parameters as last seen (``_OptState``).
        self._state: "weakref.WeakKeyDictionary[Any, _OptState]" = weakref.WeakKeyDictionary()
        self._last: Any = None  # (weakref to the last optimizer seen, its _OptState)
        # The last probe: (id of its optimizer, _grad_mark of its params); an optimizer stepping
        # inside another's step, on grads unchanged since, is not probed.
        self._probed: Any = None
        self._installed = False

    # -- lifecycle

    def install(self) -> "GradNormProbe":
        """Wrap ``clip_grad_norm_`` and its halves (to reuse its norm) and ``GradScaler.step`` (to
        see skipped steps). Code that did ``from torch.nn.utils import clip_grad_norm_`` before
        this keeps the unwrapped function, which calls the wrapped halves (torch >= 2.6): its norm
        is reused all the same."""
        if not self._installed:
            _TAP.install(self)
            self._installed = True
            # Clips an earlier session's thread recorded and no optimizer took (their grads may
            # still be alive): never this session's.
            _TAP.local.clips = None
            _TAP.local.total = None
        return self

    def uninstall(self) -> None:
        if self._installed:
            _TAP.uninstall(self)
            self._installed = False

    def patch_late(self) -> None:
        """Take what could not be wrapped at install (FSDP1's clip, once FSDP is imported)."""
        if self._installed:
            _TAP.patch_fsdp1()

    # -- training thread

    def _opt_state(self, optimizer: Any) -> "_OptState":
        last = self._last
        if last is not None and last[0]() is optimizer:
            st = last[1]()
            if st is not None:
                return st
        st = self._state.get(optimizer)
        if st is None:
            st = self._state[optimizer] = _OptState()
            st.scale_in_dict = hasattr(optimizer, "__dict__") and not any(
                "__getattr__" in vars(k) or "grad_scale" in vars(k) for k in type(optimizer).__mro__
            )
        # Weak both ways: a discarded optimizer's parameters are not kept alive by this shortcut.
        self._last = (weakref.ref(optimizer), weakref.ref(st))
        return st

    def _optimizer_params(self, optimizer: Any) -> list[Any]:
        return self._opt_state(optimizer).parameters(optimizer)

    def on_optimizer_step(self, optimizer: Any) -> PendingGradNorm | None:
        """Call from the optimizer step pre-hook. Returns None on steps not probed (``every``) or
        when no parameter has a grad. Never reads a device value."""
        clip = _TAP.take_clip(optimizer)
        prev = self._probed
        if prev is not None and prev[0] != id(optimizer) and _mark_holds(prev[1]) and nested_optimizer_step():
            # An optimizer whose step runs another's (timm's Lookahead, SAM, Ranger: its base
            # optimizer; ZeroRedundancyOptimizer: its shard's), the grads unchanged since the outer
            # step's probe: one step, probed once. Both probes' squares summed were sqrt(2) times
            # the norm (ZeRO: the shard's added, a different number on each rank). The
            # outer optimizer's next step takes this path, which sets _probed, not the C one
            # (GradNormCore's common step needs the optimizer stepping to be ``_last``'s).
            self._last = None
            if clip:
                _TAP.keep(clip)
            return None
        st = self._opt_state(optimizer)
        n = st.calls
        st.calls = n + 1
        if n % self.every:
            return None
        pending = self._probe(optimizer, clip, st)
        if pending is not None:
            mark = _grad_mark(st.params)
            self._probed = None if mark is None else (id(optimizer), mark)
        return pending

    def _skipped_step(self, optimizer: Any) -> None:
        pending = self._probe(optimizer, _TAP.take_clip())
        if pending is None:
            return
        pending.skipped = True
        if self.on_skipped is not None:
            self.on_skipped(pending)

    def _probe(self, optimizer: Any, clip: Any, st: "_OptState | None" = None) -> PendingGradNorm | None:
        torch = _TORCH or _torch()

        if st is None:
            st = self._opt_state(optimizer)
        params = st.parameters(optimizer)
        if not params:
            return None
        if params[0].is_cuda and torch.cuda.is_current_stream_capturing():
            # The optimizer step is being captured into a CUDA graph: the probe's kernels would
            # join the graph and its host copy hold the capture's values. Unknown instead.
            return None
        # Set by GradScaler.step for fused optimizers, as an instance attribute: read from the
        # instance's dict where its class can put it nowhere else (getattr of a missing
        # attribute raises and catches inside, ~0.7 us).
        scale = optimizer.__dict__.get("grad_scale") if st.scale_in_dict else getattr(optimizer, "grad_scale", None)
        values = None
        sharded = False
        from_clip = False
        per_tensor = False
        fsdp1 = st.fsdp1
        if clip is not None:
            values, sharded, from_clip = self._with_clips(clip, params, fsdp1)
            if values is _UNKNOWN:
                return None
        if values is None:
            if fsdp1:
                # FSDP1 flat grads: sharded or not depends on the sharding strategy, which the
                # grads do not show. Unknown beats a plausible wrong number.
                if _TAP.patch_fsdp1():
                    return None  # its clip is wrapped only now: this step's norm went unseen
                warn_once(
                    "grads.fsdp1",
                    "stepwatch: grad_norm is null under FSDP1 (FullyShardedDataParallel) unless "
                    "you call model.clip_grad_norm_() each step (its norm is reused); FSDP2 "
                    "fully_shard is supported without it.",
                    log=log,
                )
                return None
            values = self._compute_plain(st) if st.plain else None
            if values is not None:
                sharded, per_tensor = False, True
            else:
                values, sharded = self._compute(params)
            if values is None:
                return None
        if isinstance(scale, torch.Tensor):
            if isinstance(values, list):  # _compute_plain's CPU norms, read already
                values = torch.tensor(values, dtype=st.norm_dtype)
            s = scale.to(device=values.device, dtype=torch.float32)
            values = values / s if values.dim() == 0 or per_tensor else values / torch.stack([s * s, s])
        if not isinstance(values, list) and values.is_cpu:
            values = untracked(values.tolist())  # a float or a list of floats: see _compute_plain
        host, event, device = copy_to_host(values) if not isinstance(values, (float, list)) and values.is_cuda else (None, None, -1)
        # Tensors and numbers: it cannot be part of a cycle, and it waits in the queue (see _ctracker.c).
        return untracked(PendingGradNorm(values, host, event, sharded, from_clip, False, id(optimizer), device, per_tensor))

    def _with_clips(self, clips: list[_Clip], params: list[Any], fsdp1: bool) -> tuple[Any, bool, bool]:
        """``(values, sharded, from_clip)`` of ``params``' grads before this thread's ``clips``:
        a clip of the same list (of an FSDP1 module, for its flat parameters) is reused; values
        None when no clip touched these grads (computed as usual), ``_UNKNOWN`` when the norm
        cannot be known."""
        clips = [c for c in clips if c.fresh()]
        if len(clips) > 1:  # a clip of none of these parameters (another model's) is not this step's
            ids = {id(p) for p in params}
            mine = [c for c in clips if c.params is None or any(id(p) in ids for p in c.params)]
            if len(mine) < len(clips):
                _TAP.keep([c for c in clips if c not in mine])
                clips = mine
        if len(clips) == 1:
            c = clips[0]
            if c.params is None:  # FSDP1's: the module's parameters, whatever the optimizer's list
                if fsdp1 and self.reuse_clip and c.norm_type == 2.0:
                    values, sharded = self._from_clip(c.total)
                    return values, sharded, values is not None
                return None, False, False
            if (
                self.reuse_clip
                and c.norm_type == 2.0
                and c.whole
                and c.n == len(params)
                and c.first == id(params[0])
                and c.last == id(params[-1])
            ):
                values, sharded = self._from_clip(c.total)
                if values is not None:
                    return values, sharded, True
        return self._unclip([c for c in clips if c.params is not None], params)

    def _unclip(self, clips: list[_Clip], params: list[Any]) -> tuple[Any, bool, bool]:
        """``_with_clips`` for clips of other lists than ``params``: a subset, several optimizers'
        parameters, several clips, the same parameters in another order. Each clip scaled its
        grads in place by ``min(max_norm / (total + 1e-6), 1)`` (torch's
        ``clip_grads_with_norm_``): their norm is divided by that factor again, on the device. A
        grad that a ``clip_grad_value_`` clamped has its norm from before that clamp, divided by
        the factors of the clips before it. What a clip holds beyond ``params`` is put back for
        the optimizers still to step."""
        torch = _TORCH or _torch()
        if not clips:
            return None, False, False
        whole = clips[0].whole
        for c in clips:
            if c.left is None:
                c.left = {id(p) for p in c.params}
        # the indices of the clips that scaled a grad (in the order they ran) -> its parameters
        groups: dict[tuple[int, ...], list[Any]] = {}
        mine = set()
        for p in params:
            i = id(p)
            mine.add(i)
            if p.grad is not None:
                groups.setdefault(tuple(k for k, c in enumerate(clips) if i in c.left), []).append(p)
        kept = []
        for c in clips:
            before = len(c.left)
            c.left -= mine
            rest = [p for p in c.params if id(p) in c.left and p.grad is not None]
            if rest:
                c.whole = c.whole and len(c.left) == before
                c.mark = _grad_mark(rest)
                kept.append(c)
        if kept:
            _TAP.keep(kept)
        if not any(groups):  # every key empty: no grad here was clipped
            return None, False, False
        if self.reuse_clip and len(clips) == 1 and whole and not kept and list(groups) == [(0,)]:
            # exactly this optimizer's grads, in another order: the clip's L2 norm is theirs
            values, sharded = self._from_clip(clips[0].total) if clips[0].norm_type == 2.0 else (None, False)
            if values is not None:
                return values, sharded, True
        if any(_is_dtensor(p.grad) or p.grad.is_sparse for ps in groups.values() for p in ps) or any(
            not isinstance(c.total, torch.Tensor) or _is_dtensor(c.total) or (c.pre is None and not c.max_norm > 0)
            for c in clips
        ):
            warn_once(
                "grads.unclip",
                "stepwatch: grad_norm is null on steps where clip_grad_norm_ clipped other "
                "parameters than the optimizer's and the grads are DTensors or sparse (or "
                "max_norm <= 0): their pre-clip norm is not known; clip the optimizer's "
                "parameters (the same list) to have it reused.",
                log=log,
            )
            return _UNKNOWN, False, False
        norms = []
        for key, ps in groups.items():
            first_value = next((j for j, k in enumerate(key) if clips[k].pre is not None), len(key))
            if first_value < len(key):  # clamped: the norm from before the clamp
                c = clips[key[first_value]]
                at = [c.index.get(id(p)) for p in ps]
                if None in at:  # a grad it did not see (it had none then)
                    return _UNKNOWN, False, False
                # views by int index: no host-to-device copy of an index tensor (no sync)
                n = torch.linalg.vector_norm(torch.stack([c.pre[i] for i in at]), 2.0)
            else:
                n = _local_norm([p.grad for p in ps])
            for k in key[:first_value]:
                c = clips[k]
                n = n / torch.clamp(c.max_norm / (c.total + 1e-6), max=1.0).to(n.device)
            norms.append(n)
        dev = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), 2.0), False, False

    @staticmethod
    def _from_clip(total: Any) -> tuple[Any, bool]:
        import torch

        if not isinstance(total, torch.Tensor):
            return None, False
        zero = torch.zeros((), dtype=torch.float32, device=total.device)
        if _is_dtensor(total):
            local = total.to_local().float()
            if any(pl.is_partial() for pl in total.placements):
                sq = local * local / _replica_factor(total)
                return torch.stack([sq, zero]), True
            return torch.stack([zero, local]), False
        total = total.detach()
        return torch.stack([zero, total if total.dtype == torch.float64 else total.float()]), False

    def _compute_plain(self, st: "_OptState") -> Any:
        """The common case in three kernels: every parameter a plain dense tensor (no DTensor,
        no FSDP1 flat parameter; learnt once per parameter list), so the grads need no sorting:
        ``stack(_foreach_norm(grads))``, each grad's norm as a 1-D tensor of ``st.norm_dtype`` (the
        per-tensor norms of ``_local_norm``'s arithmetic; ``resolve`` takes their root sum of
        squares, ``PendingGradNorm.per_tensor``). None when there is no grad; a
        sparse grad or grads on several devices make torch refuse, and this optimizer takes the
        general path (``_compute``) from then on.

        CPU grads: the norms read at once, as Python floats (each one's ``item()``: their values are
        final, a CPU kernel has run when it returns; 0.15 µs a norm, where ``stack(...).tolist()``
        took 1.7 µs for two norms and 9.3 for 32). Until the forty-first session they were
        kept as ``_foreach_norm`` made them (small 0-d tensors, stacked where read, off the training
        thread), up to a pass later: hundreds of steps' small allocations among each step's freed
        buffers kept glibc's heap from shrinking (+150 MiB over 800 steps of a loop that keeps
        nothing, and a memory_growth finding). A float allocates nothing of torch's."""
        torch = _TORCH or _torch()
        grads = [g for p in st.params if (g := p.grad) is not None]
        if not grads:
            return None
        if type(grads[0]) is not torch.Tensor and _is_dtensor(grads[0]):
            st.plain = False
            return None
        try:
            norms = torch._foreach_norm(grads, 2.0, dtype=st.norm_dtype)
            if grads[0].is_cpu:
                return untracked([n.item() for n in norms])  # floats: no tensor outlives the step
            return torch.stack(norms)
        except (RuntimeError, NotImplementedError, TypeError):
            st.plain = False
            return None

    def _compute(self, params: list[Any]) -> tuple[Any, bool]:
        import torch

        plain: list[Any] = []
        sharded: dict[int, list[Any]] = {}
        for p in params:
            g = p.grad
            if g is None:
                continue
            if _is_dtensor(g):
                if any(pl.is_shard() or pl.is_partial() for pl in g.placements):
                    sharded.setdefault(_replica_factor(g), []).append(g.to_local())
                else:
                    plain.append(g.to_local())
            else:
                if g.is_sparse and g.is_cuda and not g.is_coalesced():
                    # Summing an uncoalesced sparse grad's duplicates (coalesce) waits for the
                    # device to learn the new size: unknown rather than a sync every step.
                    warn_once(
                        "grads.sparse",
                        "stepwatch: grad_norm is null while a CUDA gradient is sparse and "
                        "uncoalesced (e.g. nn.Embedding(sparse=True)): its norm needs a "
                        "device sync stepwatch does not make.",
                        log=log,
                    )
                    return None, False
                plain.append(g)
        if not plain and not sharded:
            return None, False
        dev = (plain[0] if plain else next(iter(sharded.values()))[0]).device
        rep = _local_norm(plain) if plain else torch.zeros((), dtype=torch.float32, device=dev)
        if sharded:
            parts = []
            for factor, ts in sharded.items():
                nrm = _local_norm(ts).to(dev)
                parts.append(nrm * nrm / factor)
            sq = torch.stack(parts).sum()
        else:
            sq = torch.zeros((), dtype=torch.float32, device=dev)
        return torch.stack([sq, rep.to(dev)]), bool(sharded)

    # -- background thread

    @staticmethod
    def resolve(pending: PendingGradNorm) -> GradNormResult | None:
        """The value, or None if the device has not produced it yet (poll again later)."""
        if pending.event is not None:
            if not event_done(pending.event, pending.device):
                return None
            got = pending.host.tolist()
        else:
            v = pending.values
            # CPU values were read on the training thread (floats: _compute_plain says why); any
            # other device's (not CUDA: no event) are read here.
            if isinstance(v, (float, list)):
                got = v
            else:
                got = v.detach().to("cpu").tolist()
        sq, rep = (0.0, _root_sum_sq(got)) if pending.per_tensor else _pair(got)
        nonfinite = not (math.isfinite(sq) and math.isfinite(rep))
        norm = None if pending.sharded else rep
        return GradNormResult(norm, (sq, rep), pending.sharded, nonfinite, pending.skipped, pending.from_clip)


def _root_sum_sq(norms: list[float]) -> float:
    """The L2 norm of all the grads from each one's norm (float64; ``vector_norm`` of the stacked
    norms gives the same to float32's precision), NaN when one is NaN as torch's reduction gives
    it (``math.hypot`` says inf when another is inf)."""
    n = math.hypot(*norms)
    if math.isinf(n) and any(x != x for x in norms):
        return math.nan
    return n


def _pair(v: Any) -> tuple[float, float]:
    """``PendingGradNorm.values`` as read: a pair, or one number (the plain norm; sharded part 0)."""
    if isinstance(v, list):
        return v[0], v[1]
    return 0.0, v


class _OptState:
    """The probe's memory of one optimizer: steps seen, and its parameters as a flat list,
    rebuilt when a group's list or its length changes (``add_param_group``, a new list)."""

    __slots__ = ("calls", "params", "shape", "plain", "fsdp1", "norm_dtype", "scale_in_dict", "__weakref__")

    def __init__(self) -> None:
        self.calls = 0
        self.scale_in_dict = False  # optimizer.grad_scale can only be in the instance's __dict__
        self.params: list[Any] = []
        self.shape: Any = None
        self.plain = False
        self.fsdp1 = False  # FSDP1 flat parameters (the first parameter tells)
        self.norm_dtype: Any = None  # _compute_plain's: fp64 when a parameter is fp64, else fp32

    def parameters(self, optimizer: Any) -> list[Any]:
        groups = optimizer.param_groups
        if len(groups) == 1:
            ps = groups[0]["params"]
            shape: Any = (id(ps), len(ps))
        else:
            shape = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if shape != self.shape:
            self.params = [p for g in groups for p in g["params"]]
            self.shape = shape
            self.fsdp1 = bool(self.params) and bool(getattr(self.params[0], "_fsdp_flattened", False))
            torch = _TORCH or _torch()
            dtypes = {getattr(p, "dtype", None) for p in self.params}
            self.plain = bool(self.params) and all(
                not _is_dtensor(p) and not getattr(p, "_fsdp_flattened", False) for p in self.params
            ) and not any(dt is not None and dt.is_complex for dt in dtypes)  # complex: _local_norm's
            # torch refuses to narrow an fp64 grad's norm to fp32; fp32 and lower keep fp32 norms
            self.norm_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        return self.params


def merge_results(results: Sequence[GradNormResult]) -> GradNormResult:
    """One step's norm from several optimizers' (disjoint parameters): root of the sum of squares."""
    if not results:
        raise ValueError("results must hold at least one GradNormResult")
    if len(results) == 1:
        return results[0]
    sq = sum(r.local[0] for r in results)
    rep = math.sqrt(sum(r.local[1] ** 2 for r in results))
    sharded = any(r.sharded for r in results)
    norm = None if sharded else rep
    return GradNormResult(
        norm,
        (sq, rep),
        sharded,
        any(r.nonfinite for r in results),
        any(r.skipped for r in results),
        all(r.from_clip for r in results),
    )


class _PyGradNormCore:
    """The collector's optimizer step in Python: the path metrics/_cmetrics.c's ``GradNormCore``
    runs in C for its common case (and calls for every other), and the step's ``take``; the one
    used where that extension was not built. Its state is ``GradNormCollector``'s."""

    __slots__ = ("_buf", "probe")

    def on_optimizer_step(self, optimizer: Any) -> None:
        p = self.probe.on_optimizer_step(optimizer)
        if p is not None:
            self._buf.append(p)

    def take(self) -> list[PendingGradNorm] | None:
        buf = self._buf
        if not buf:
            return None
        self._buf = []
        return untracked(buf)  # of PendingGradNorm (untracked too): nothing in it refers back


try:  # the common step in C (metrics/_cmetrics.c): the same probe, less time a step
    from ._cmetrics import GradNormCore as _GradNormCore, _bind_grads, _bind_grads_torch
except ImportError:  # not built here (no compiler): the Python above
    _GradNormCore = _PyGradNormCore
    _bind_grads = _bind_grads_torch = None


def _bind_torch() -> None:
    """What the C core calls of torch, once torch is imported (importing stepwatch does not)."""
    if _bind_grads_torch is not None:
        torch = _torch()
        _bind_grads_torch(torch.Tensor, torch._foreach_norm, torch.stack, torch.cuda.is_current_stream_capturing,
                          copy_to_host)


class _GradNormMethods(Collector):
    """The step tracker's collector for grad norms (``extras["grad_norm"]``).

    Training thread: ``on_optimizer_step(optimizer)`` from the optimizer step pre-hook (in C where
    metrics/_cmetrics.c was built: ``_PyGradNormCore`` is its Python); the probes of
    GradScaler-skipped steps arrive by themselves. ``take()`` at step end hands over the step's
    pending probes (a list, or None). Background thread: ``resolve_step(pendings)``.
    """

    name = "grad_norm"

    def __init__(self, every: int = 1) -> None:
        self._buf: list[PendingGradNorm] = []
        self.probe = GradNormProbe(every, on_skipped=self._add)

    def install(self) -> "_GradNormMethods":
        self.probe.install()
        _bind_torch()
        return self

    def uninstall(self) -> None:
        self.probe.uninstall()

    def _add(self, pending: PendingGradNorm) -> None:
        self._buf.append(pending)

    def on_manual_update(self, params: Any) -> None:
        """A loop without a torch optimizer: the grads at the end of a backward
        (``Hub.add_manual_update_observer``; ``params`` stands for the optimizer). An optimizer
        step in the same record outranks this probe (``resolve_step``): the same grads, once."""
        n = len(self._buf)
        self.on_optimizer_step(params)
        buf = self._buf
        if len(buf) > n:
            buf[-1].manual = True

    @staticmethod
    def resolve_step(pendings: Sequence[PendingGradNorm] | None) -> GradNormResult | None | bool:
        """The step's merged result; ``False`` while a value is still on its way from the device
        (poll again); None when the step had no probe."""
        if not pendings:
            return None
        if len(pendings) > 1:
            manual = [p.manual for p in pendings]
            if any(manual) and not all(manual):
                # The loop's first optimizer stepped after a backward probed without one (an
                # optimizer made after the first backward): its probe is of the same grads.
                pendings = [p for p, m in zip(pendings, manual) if not m]
            # Each optimizer's last probe: one optimizer probed twice before the record ended (a
            # subclass whose step calls super().step(), both wrapped by torch; an optimizer
            # stepped twice; a step that raised and was skipped, merged into the next record)
            # summed both squares. Several optimizers' (disjoint parameters) add up.
            last = {}
            for p in pendings:
                last[p.optimizer_id] = p
            pendings = list(last.values())
        results = []
        for p in pendings:
            r = GradNormProbe.resolve(p)
            if r is None:
                return False
            results.append(r)
        return merge_results(results)


class GradNormCollector(_GradNormMethods, _GradNormCore):  # type: ignore[misc,valid-type]
    __doc__ = _GradNormMethods.__doc__
    take = _GradNormCore.take  # the core's, not Collector's (before it in the MRO)


class PyGradNormCollector(_GradNormMethods, _PyGradNormCore):
    """``GradNormCollector`` with the Python optimizer step always (tests compare the two)."""

    take = _PyGradNormCore.take


if _bind_grads is not None:
    # What the C core reads and builds; False (slots not plain) leaves every step to the Python.
    _bind_grads(_PyGradNormCore.on_optimizer_step, _TAP, GradNormProbe, _OptState, PendingGradNorm)


# ----------------------------------------------------------------------------- cross-rank


def _default_slots(world_size: int) -> int:
    """Steps each rank's ring of store keys holds: 1024 for a small job (a rank publishes up to
    that many steps ahead of its oldest unresolved one: a 0.25 s pass of a loop at 4000 steps/s),
    fewer as the world grows, so the store holds at most ~65,536 keys (64 steps at least)."""
    return max(64, min(1024, 65536 // (world_size + 1)))


class StoreNormExchange:
    """Cross-rank sum of sharded sums of squares through the c10d store (background thread).

    Each rank ``publish``es its local value under a step slot; rank 0 ``poll``s until all are in,
    combines them and publishes the global norm; every other rank ``poll``s for that. ``poll``
    never blocks (``store.check`` before any read), so a slow or dead rank only delays the number.
    Keys are reused every ``slots`` steps (by default from the world size, ``_default_slots``),
    so the store holds at most ``slots * (world_size + 1)`` keys; a value carries its step, and
    one from a slot's earlier step is never taken for a later one. ``publish_many`` and
    ``poll_many`` do the same for many steps in a few store calls (a pass's records): a fast
    loop's steps go through the store together, not one round trip each. The caller keeps a
    rank's published, unresolved steps within ``slots`` of each other (``GradNormEnricher``), so
    no slot is written again before every rank has read it.
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, prefix: str = "stepwatch/gradnorm",
                 slots: int | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) and world_size >= 1, got rank={rank}, world_size={world_size}")
        if slots is None:
            slots = _default_slots(world_size)
        if slots < 2:
            raise ValueError(f"slots must be >= 2, got {slots}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.slots = prefix, slots

    def _key(self, step: int, who: str) -> str:
        return f"{self.prefix}/{step % self.slots}/{who}"

    def _set_many(self, keys: list[str], values: list[str]) -> None:
        if len(keys) == 1:
            self.store.set(keys[0], values[0])
        elif keys:
            multi_set = getattr(self.store, "multi_set", None)
            if multi_set is not None:
                multi_set(keys, values)
            else:
                for k, v in zip(keys, values):
                    self.store.set(k, v)

    def publish(self, step: int, local: tuple[float, float]) -> None:
        self.publish_many([(step, local)])

    def publish_many(self, items: Sequence[tuple[int, tuple[float, float]]]) -> None:
        """This rank's local values of several steps, in one store call where it has ``multi_set``."""
        me = str(self.rank)
        self._set_many([self._key(s, me) for s, _ in items],
                       [f"{s} {float(local[0])!r} {float(local[1])!r}" for s, local in items])

    def poll(self, step: int) -> float | None:
        """The global norm of ``step`` once available, else None."""
        return self.poll_many([step]).get(step)

    def poll_many(self, steps: Sequence[int], *, combine: bool = False) -> dict[int, float]:
        """The global norms available now of ``steps`` (given in order), by step. It reads up to
        the first step whose keys are not all in the store (a binary search of ``check`` calls,
        then one ``multi_get``): records leave in order, so the later ones would wait behind it
        anyway. Rank 0 (or any rank with ``combine``: every rank's value is in, the global norm
        is not, as at shutdown after rank 0 has gone) combines the ranks' values itself; rank 0
        publishes what it combined for the others."""
        if not steps:
            return {}
        mine = combine or self.rank == 0
        who = [str(r) for r in range(self.world_size)] if mine else ["global"]
        keys = [[self._key(s, w) for w in who] for s in steps]
        n = self._in_store(keys)
        if not n:
            return {}
        raw = self.store.multi_get([k for ks in keys[:n] for k in ks])
        out: dict[int, float] = {}
        per = len(who)
        for i, s in enumerate(steps[:n]):
            try:
                if mine:
                    vals = []
                    for item in raw[i * per:(i + 1) * per]:
                        got, sq, rep = item.decode().split()
                        if int(got) != s:
                            break  # an older step's value still in this slot
                        vals.append((float(sq), float(rep)))
                    if len(vals) == per:
                        out[s] = combine_sharded(vals)
                else:
                    got, norm = raw[i].decode().split()
                    if int(got) == s:
                        out[s] = float(norm)
            except (ValueError, UnicodeDecodeError):  # not a value of ours: not taken
                continue
        if self.rank == 0 and out:
            self._set_many([self._key(s, "global") for s in out], [f"{s} {v!r}" for s, v in out.items()])
        return out

    def _in_store(self, keys: list[list[str]]) -> int:
        """How many of the leading steps have all their keys in the store."""
        check = self.store.check
        n = len(keys)
        if check([k for ks in keys for k in ks]):
            return n
        lo, hi = 0, n  # steps [0, lo) are in; [0, hi) are not all in
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if check([k for ks in keys[lo:mid] for k in ks]):
                lo = mid
            else:
                hi = mid
        return lo


# ----------------------------------------------------------------------------- findings


class GradNormSources:
    """Which optimizers made a record's norm, from the enricher to the spike detector (both on
    the pipeline's thread; the record has no field for it, and needs none in its schema).

    The enricher notes a record here only when its norm comes from other optimizers than the
    first it ever saw (a second model's, say): a job with one optimizer, nearly every job, notes
    nothing, and its records keep the detector's one history. Keyed by the record's id, holding
    the record (an id is never another record's while it is held); the detector takes the entry
    when it observes the record. Bounded: one that is never observed (a detector that failed and
    was left out) is dropped after ``_CAP`` newer ones."""

    _CAP = 4096

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[Any, Any]] = {}

    def note(self, rec: Any, key: Any) -> None:
        by_id = self.by_id
        by_id[id(rec)] = (rec, key)
        if len(by_id) > self._CAP:
            try:
                del by_id[next(iter(by_id))]
            except (StopIteration, RuntimeError, KeyError):  # another session's thread changed it meanwhile
                pass

    def take(self, rec: Any) -> Any:
        """The record's key (None: the first optimizer's, or not noted)."""
        got = self.by_id.pop(id(rec), None)
        if got is None:
            return None
        return got[1] if got[0] is rec else None



class _Window:
    """One rolling history of finite norms: in arrival order and sorted (the median without a
    sort per record)."""

    __slots__ = ("recent", "sorted")

    def __init__(self) -> None:
        from collections import deque

        self.recent: deque[float] = deque()
        self.sorted: list[float] = []


# A norm above the absolute threshold and at most this many times its rolling median is high all
# along (``grad_norm_spike``'s ``data.steady``: no capture), not a jump.
STEADY_RATIO = 2.0


class GradNormSpikeDetector:
    """Turns resolved grad norms into findings (background thread).

    ``nonfinite_grads`` for every non-finite norm (skipped steps included); ``grad_norm_spike``
    for each step whose norm exceeds ``abs_threshold`` (reference B.7: 10) or ``factor`` x the
    rolling median of the last ``window`` finite norms (after ``min(window, 10)`` of them). The
    session's rate limit makes a run of them one episode, counted.

    The rolling history is kept per optimizer (per set of optimizers, for a record whose step
    stepped several): a process that trains two models with optimizers of their own (a small
    probe beside the main model, stepping in turn) has two scales of norm, and one median over
    both called one model's ordinary norm a spike of the other's. ``GradNormEnricher`` says
    which optimizers made a record's norm (``sources``, the one it was given); the first it saw keeps the main
    history, each other one gets its own (at most ``_MAX_HISTORIES``, the least recently used
    dropped first).
    """

    _MAX_HISTORIES = 16

    def __init__(self, abs_threshold: float = 10.0, factor: float = 5.0, window: int = 100,
                 sources: "GradNormSources | None" = None,
                 clipping: "Callable[[], tuple[str, float] | None] | None" = None) -> None:
        if not abs_threshold > 0 or not factor > 1 or window < 2:
            raise ValueError(
                "abs_threshold must be > 0, factor > 1 and window >= 2; got "
                f"abs_threshold={abs_threshold!r}, factor={factor!r}, window={window!r}"
            )
        self.abs_threshold, self.factor, self.window = abs_threshold, factor, window
        self._main = _Window()  # the first optimizer's norms (a job's only one, nearly always)
        self._others: dict[Any, _Window] = {}  # other optimizers' (sets'), least recently used first
        self.sources = sources if sources is not None else GradNormSources()  # shared with the enricher
        self.clipping = clipping  # the job's last clip (``clipped``), when it clips

    # the main history's norms, in order and sorted (tests read them)
    @property
    def _recent(self) -> Any:
        return self._main.recent

    @property
    def _sorted(self) -> list[float]:
        return self._main.sorted

    def _history(self, key: Any) -> _Window:
        if key is None:
            return self._main
        others = self._others
        w = others.pop(key, None)
        if w is None:
            w = _Window()
            if len(others) >= self._MAX_HISTORIES:
                del others[next(iter(others))]
        others[key] = w  # most recently used last
        return w

    def _median(self, w: _Window | None = None) -> float | None:
        s = (w or self._main).sorted
        n = len(s)
        if n < min(self.window, 10):
            return None
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2  # as statistics.median

    def _add(self, norm: float, w: _Window | None = None) -> None:
        w = w or self._main
        if len(w.recent) == self.window:
            old = w.recent.popleft()
            del w.sorted[bisect.bisect_left(w.sorted, old)]
        w.recent.append(norm)
        bisect.insort(w.sorted, norm)

    def observe(self, rec: Any) -> list[Any]:
        """The session's detector interface: a ``StepRecord`` in, findings out."""
        norm = rec.grad_norm
        if norm is None:
            return []
        key = self.sources.take(rec) if self.sources.by_id else None
        if math.isfinite(norm):  # the common case, without a result object
            f = self._finite(rec.step, norm, rec.rank, rec.time, key)
        else:
            res = GradNormResult(norm, (0.0, norm), False, True, bool(rec.skipped), False)
            f = self.observe_result(rec.step, res, rank=rec.rank, when=rec.time)
        return [f] if f is not None else []

    def observe_many(self, records: list[Any]) -> list[Any]:
        """``observe`` over a pass's records in one call: the same findings, in order."""
        out = []
        finite, isfinite, sources = self._finite, math.isfinite, self.sources
        for rec in records:
            norm = rec.grad_norm
            if norm is None:
                continue
            if isfinite(norm):
                f = finite(rec.step, norm, rec.rank, rec.time, sources.take(rec) if sources.by_id else None)
                if f is not None:
                    out.append(f)
            else:
                out.extend(self.observe(rec))
        return out

    def observe_result(self, step: int | None, result: GradNormResult, *, rank: int = 0, when: float | None = None,
                       key: Any = None) -> Any:
        """Returns a ``Finding`` or None. ``result.norm`` must be the global norm (combined);
        ``key`` names the optimizers that made it (None: the main history)."""
        norm = result.norm
        if result.nonfinite or (norm is not None and not math.isfinite(norm)):
            from ..analysis.kinds import make_finding

            return make_finding(
                "nonfinite_grads",
                rank=rank,
                step=step,
                when=when,
                summary=f"non-finite gradients (grad norm {norm}){'; GradScaler skipped the step' if result.skipped else ''}",
                data={"grad_norm": None if norm is None else str(norm), "skipped": result.skipped},
            )
        if norm is None:
            return None
        return self._finite(step, norm, rank, when, key)

    def _finite(self, step: int | None, norm: float, rank: int, when: float | None, key: Any = None) -> Any:
        """A finite norm: into its optimizer's window; a ``grad_norm_spike`` Finding when it is
        over a threshold, else None."""
        w = self._main if key is None else self._history(key)
        median = self._median(w)
        self._add(norm, w)
        over_abs = norm > self.abs_threshold
        over_rel = median is not None and median > 0 and norm > self.factor * median
        if not (over_abs or over_rel):
            return None
        # Every step over a threshold is a finding: the rate limit (analysis/ratelimit.py) writes
        # an episode's first and its closing "N in all". Held back here, a 50-step spike was one
        # finding, and the findings file said one step.
        from ..analysis.kinds import make_finding

        # Above the absolute threshold with its rolling median known and no jump from it (at most
        # STEADY_RATIO times it): high all along (a fresh ResNet's 50, a WGAN-GP critic's 13), not a
        # spike to capture the steps after. (Under the relative factor alone, 10.9 from a median of
        # 2.25 was "high all along".)
        steady = over_abs and not over_rel and median is not None and norm <= STEADY_RATIO * median
        if steady:
            why = f"above {self.abs_threshold:g}, and high all along: rolling median {median:.3g}"
        elif over_abs:
            why = f"above {self.abs_threshold:g}"
        else:
            why = f"{norm / median:.1f}x the rolling median {median:.3g}"
        data = {"grad_norm": norm, "median": median, "abs_threshold": self.abs_threshold, "factor": self.factor,
                # how bad, for the rate limit (analysis/ratelimit.py)
                "magnitude": norm / median if median else None, "steady": steady}
        clipped = self.clipping() if self.clipping is not None else None
        if clipped is not None:
            data["clip_max"] = clipped[1]
        return make_finding(
            "grad_norm_spike",
            rank=rank,
            step=step,
            when=when,
            summary=f"grad norm {norm:.3g} ({why})",
            data=data,
            action=None if clipped is None else clipped_action(*clipped),
        )


def clipped_action(how: str, limit: float) -> str:
    """``grad_norm_spike``'s action for a job that clips already: its norm is the pre-clip one."""
    what = "max_norm" if how == "clip_grad_norm_" else "clip_value"
    return (f"The job clips already ({how}, {what} {limit:g}), and this norm is before the clip: the update "
            "was bounded, but the gradient was not. Inspect the batch of that step and the learning-rate "
            "schedule; lower the LR or warm up longer; check for bad data. If spikes recur, the clip only "
            "hides them.")


def clipping() -> tuple[str, float] | None:
    """The job's last clip, ``(function, max_norm or clip_value)``, None while it has not clipped."""
    return _TAP.clipped


# ----------------------------------------------------------------------------- record enricher

# Shutdown's final pass: how long the exchange waits for the other ranks' values (or rank 0's
# global norms) of the records still held, before they leave with what came (null at worst).
# It runs inside the pipeline's shutdown budget (_pipeline.SHUTDOWN_TIMEOUT_S), beside the
# straggler exchange's own 0.5 s.
FINAL_WAIT_S = 0.5
_FINAL_POLL_S = 0.01
# A step published for the other ranks' sake after its own record left (a non-finite local
# norm is NaN at once): forgotten if its global norm has not come in this long (a peer gone).
_ORPHAN_S = 30.0


class GradNormEnricher:
    """Background thread: fills ``record.grad_norm`` from ``extras["grad_norm"]`` (the
    ``GradNormCollector``'s pending probes). Returns False while a value is still on the device or
    (sharded grads) still awaited from the other ranks; with ``force`` it gives up (None).
    ``exchange`` is a ``StoreNormExchange`` for sharded (FSDP2) grads; without one, a sharded norm
    is None (unknown) rather than this rank's partial value.

    Sharded norms go through the store a pass's records at a time: the pipeline hands every
    record it holds to ``look_ahead`` once a pass, which publishes each one whose local value is
    in (not only the oldest's: one step per pass could never keep up with a fast loop) and polls
    the global norms of all of them; ``enrich`` then takes each record's as the pipeline lets
    them go, in order. A rank publishes no step ``slots`` or more past its oldest unresolved one
    (the store's ring, see ``StoreNormExchange``). A non-finite local value is NaN at once, and
    is still published: the other ranks' records of that step get their (non-finite) global
    norm instead of waiting for the hold bound. A record whose other ranks' values never come
    leaves when the pipeline forces it (``_pipeline._MAX_HOLD_S``, or shutdown), with the norm
    combined from the values in the store if every rank's is there, else None. A store that
    fails (its host process gone) ends the exchange: sharded norms are None from then on, with
    one warning.
    """

    def __init__(self, exchange: "StoreNormExchange | Callable[[], StoreNormExchange | None] | None" = None,
                 sources: "GradNormSources | None" = None) -> None:
        self.sources = sources if sources is not None else GradNormSources()  # the spike detector's (GradNormSources)
        # A callable is asked on first need: the process group often starts after stepwatch.
        self._make = exchange if callable(exchange) and not isinstance(exchange, StoreNormExchange) else None
        self.exchange = None if self._make is not None else exchange
        self._waiting: dict[int, float] = {}  # steps published, global norm not in yet -> when published
        self._gone: set[int] = set()  # rank 0: of those, steps whose record left (NaN), combined for the others
        self._norms: dict[int, float] = {}  # global norms polled in, not yet taken by their record
        self._first_key: Any = None  # the first optimizers seen: their records' norms need no note (GradNormSources)
        self._failed = False  # the store failed: no exchange any more

    def _ex(self) -> "StoreNormExchange | None":
        if self.exchange is None and self._make is not None and not self._failed:
            self.exchange = self._make()
        return None if self._failed else self.exchange

    def _store_failed(self, exc: BaseException) -> None:
        self._failed = True
        self._waiting.clear()
        self._gone.clear()
        warn_once(
            "grads.store",
            "stepwatch: the grad-norm exchange through the c10d store failed (%s: %s); sharded grad "
            "norms are null from here on",
            type(exc).__name__, exc, log=log,
        )

    def _note(self, rec: Any, pend: Sequence[PendingGradNorm]) -> None:
        """Tell the spike detector which optimizers made this norm when they are not the first ones."""
        key = pend[0].optimizer_id if len(pend) == 1 else tuple(sorted({p.optimizer_id for p in pend}))
        if self._first_key is None:
            self._first_key = key
        elif key != self._first_key:
            self.sources.note(rec, key)

    def _publish(self, ex: StoreNormExchange, items: list[tuple[int, tuple[float, float]]]) -> None:
        if not items:
            return
        ex.publish_many(items)
        now = time.monotonic()
        for s, _ in items:
            self._waiting[s] = now

    def _poll(self, ex: StoreNormExchange, steps: list[int], *, combine: bool = False) -> None:
        if not steps:
            return
        for s, norm in ex.poll_many(steps, combine=combine).items():
            self._waiting.pop(s, None)
            if s in self._gone:
                self._gone.discard(s)
            else:
                self._norms[s] = norm
        if len(self._norms) > 4 * ex.slots:  # records that never came to take theirs
            for s in sorted(self._norms)[: len(self._norms) - 2 * ex.slots]:
                del self._norms[s]

    def _poll_orphans(self, ex: StoreNormExchange) -> None:
        """Rank 0: the global norms of steps whose own record has left (non-finite), which the
        other ranks' records of those steps wait for; forgotten after ``_ORPHAN_S``."""
        gone = self._gone
        if not gone:
            return
        self._poll(ex, sorted(gone))
        now = time.monotonic()
        for s in [s for s in gone if s not in self._waiting or now - self._waiting[s] > _ORPHAN_S]:
            gone.discard(s)
            self._waiting.pop(s, None)

    def look_ahead(self, items: Sequence[tuple[Any, dict[str, Any]]], *, final: bool = False) -> None:
        """The pipeline's held records this enricher has not finished (oldest first), once a pass:
        publish the local value of each one that has it, poll the global norms of all (a
        bounded wait for them in shutdown's ``final`` pass)."""
        waiting, norms = self._waiting, self._norms
        ex = None
        batch: list[tuple[int, tuple[float, float]]] = []
        want: list[int] = []
        lo = None
        for rec, extras in items:
            pend = extras.get("grad_norm")
            if not pend or not any(p.sharded for p in pend):  # plain and DDP grads: nothing to exchange
                continue
            if ex is None:
                ex = self._ex()
                if ex is None:
                    return
                lo = min(waiting) if waiting else None
            s = rec.step
            if s in norms:
                continue
            if s in waiting:
                want.append(s)
                continue
            r = GradNormCollector.resolve_step(pend)
            if not r or not r.sharded:  # still on the device: tried again next pass
                continue
            if lo is not None and s - lo >= ex.slots:
                break  # the ring is full up to here: the rest once older steps are resolved
            batch.append((s, r.local))
            want.append(s)
            lo = s if lo is None else min(lo, s)
        if ex is None:  # no sharded record held: rank 0 may still owe the others a non-finite step's norm
            ex = None if self._failed else self.exchange
            if ex is None or not self._gone:
                return
        try:
            self._publish(ex, batch)
            self._poll_orphans(ex)
            want = [s for s in want if s in waiting and s not in self._gone]
            self._poll(ex, want)
            if final:
                # Shutdown: every other rank combines the values itself as soon as they are all in
                # (rank 0 may be shutting down too, or gone): one wait on the slowest rank, not two.
                deadline = time.monotonic() + FINAL_WAIT_S
                while time.monotonic() < deadline:
                    want = [s for s in want if s in waiting]
                    if not want:
                        break
                    time.sleep(_FINAL_POLL_S)
                    self._poll(ex, want, combine=True)
        except RuntimeError as exc:  # torch.distributed.DistError: the store's host is gone
            self._store_failed(exc)

    def enrich(self, rec: Any, extras: dict[str, Any], *, force: bool) -> bool:
        pend = extras.get("grad_norm")
        if not pend:
            return True
        r = GradNormCollector.resolve_step(pend)
        if r is False:
            if force:
                rec.grad_norm = None
                return True
            return False
        if r is None:
            return True
        if not r.sharded:
            rec.grad_norm = r.norm
            if r.norm is not None:
                self._note(rec, pend)
            return True
        ex = self._ex()
        if ex is None:
            rec.grad_norm = None
            return True
        s = rec.step
        norm = self._norms.pop(s, None)
        if norm is None:
            try:
                norm = self._fetch(ex, s, r, force)
            except RuntimeError as exc:  # torch.distributed.DistError: the store's host is gone
                self._store_failed(exc)
                norm = None
            if norm is False:
                return False
        elif r.nonfinite:
            norm = float("nan")
        rec.grad_norm = norm
        if norm is not None:
            self._note(rec, pend)
        return True

    def _fetch(self, ex: StoreNormExchange, s: int, r: GradNormResult, force: bool) -> float | None | bool:
        """``enrich`` of a sharded record whose global norm no look-ahead has brought: publish it
        (a record that did not wait), poll it; False to wait."""
        waiting = self._waiting
        if s not in waiting:
            if waiting and s - min(waiting) >= ex.slots and not (force or r.nonfinite):
                return False  # the store's ring is full
            self._publish(ex, [(s, r.local)])
        if r.nonfinite:
            # No need to wait for the others: it is not finite. Published all the same: the other
            # ranks' records of this step get their global norm (NaN or inf) without waiting for
            # ours; rank 0 still combines it for them (``_gone``).
            if ex.rank == 0:
                self._gone.add(s)
            else:
                waiting.pop(s, None)
            return float("nan")
        self._poll_orphans(ex)
        self._poll(ex, [s])
        norm = self._norms.pop(s, None)
        if norm is None:
            if not force:
                return False
            # given up: every rank's value may be in without rank 0's global norm (rank 0 gone)
            norm = ex.poll_many([s], combine=True).get(s) if ex.rank != 0 else None
            waiting.pop(s, None)
        return norm

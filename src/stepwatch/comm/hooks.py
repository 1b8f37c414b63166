"""DDP gradient communication, timed through DDP's comm hook.

A DDP model takes one comm hook, once, and a builtin (C++) hook cannot be wrapped. So at install:

- ``DistributedDataParallel.register_comm_hook`` is patched: the user's hook is registered
  wrapped in a timing shim (their hook runs, its future is what DDP uses; the shim only adds a
  completion callback to it).
- ``DistributedDataParallel._register_builtin_comm_hook`` is patched: a builtin hook is passed
  through untouched and stepwatch logs once that this model's comm is not measured.
- ``DistributedDataParallel._pre_forward`` is patched: at a model's first forward, if nobody
  registered a hook, stepwatch registers its own timed AllReduce hook (same arithmetic as DDP's
  builtin path, see :func:`_mean_allreduce_hook`). A hook the user registers *after* that forward
  replaces the inner hook of stepwatch's shim (DDP would refuse a second registration).

Timing (what a span means): start = when DDP hands the bucket to the hook (the bucket is ready;
the collective is *enqueued* right after; gloo queues it to a worker thread, so queueing behind
earlier buckets is inside the span); end = when the hook's future completes (its completion
callback). On CUDA both ends are device events recorded on the current stream (bucket ready on
the compute stream; completion on the stream the future's callbacks run on).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from .._log import warn_once
from .spans import ALLREDUCE, CommCollector, Span, _now, group_key

_ATTR = "_stepwatch_comm"


class _ModelState:
    """Per-DDP-model bookkeeping (kept in the model's ``__dict__``)."""

    __slots__ = ("user_hook", "builtin", "shim_slot", "checked")

    def __init__(self) -> None:
        self.user_hook = False
        self.builtin: str | None = None
        self.shim_slot: list[Any] | None = None  # [hook, state] inside stepwatch's own registered shim
        self.checked = False


def _state(model: Any) -> _ModelState:
    st = model.__dict__.get(_ATTR)
    if st is None:
        st = _ModelState()
        model.__dict__[_ATTR] = st
    return st


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class DDPCommHooks:
    """Installs and removes the DDP patches; feeds spans to a :class:`CommCollector`."""

    def __init__(self, collector: CommCollector, on_error: Callable[[str, BaseException], None]) -> None:
        self.collector = collector
        self._on_error = on_error
        self._patches: list[tuple[Any, str, Any]] = []
        self.models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.unmeasured: list[str] = []
        self.active = True

    # -- install / uninstall ------------------------------------------------------------------

    def install(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        orig_register = DDP.register_comm_hook
        orig_builtin = DDP._register_builtin_comm_hook
        orig_pre_forward = DDP._pre_forward
        hooks = self

        @functools.wraps(orig_register)
        def register_comm_hook(model: Any, state: object, hook: Callable) -> None:
            if not hooks.active:
                return orig_register(model, state, hook)
            st = _state(model)
            if st.shim_slot is not None and not st.user_hook:
                # stepwatch's shim is already the reducer's hook: DDP's checks, then swap the inner hook.
                # (A second user registration goes to DDP below, which refuses it as it always does.)
                model._check_comm_hook(hook)
                if model.logger is not None:
                    model.logger._set_comm_hook_name(hook.__qualname__)
                st.shim_slot[0], st.shim_slot[1] = hook, state
                st.user_hook = True
                model._comm_hooks.append((hook, state))
                return None
            st.user_hook = True
            return orig_register(model, state, hooks.wrap(model, hook))

        @functools.wraps(orig_builtin)
        def _register_builtin_comm_hook(model: Any, comm_hook_type: Any) -> None:
            if not hooks.active:
                return orig_builtin(model, comm_hook_type)
            st = _state(model)
            if st.shim_slot is not None and not st.user_hook:
                py = hooks._python_equivalent(comm_hook_type)
                if py is not None:
                    state = model.process_group
                    warn_once(
                        f"comm.builtin_late.{comm_hook_type}",
                        "builtin comm hook %s registered after the first forward, where stepwatch's "
                        "timing hook was already in place: its Python equivalent runs instead",
                        comm_hook_type,
                    )
                    st.shim_slot[0], st.shim_slot[1] = py, state
                    st.user_hook = True
                    return None
            st.builtin = str(comm_hook_type)
            hooks._not_measured(f"builtin comm hook {comm_hook_type} cannot be wrapped")
            return orig_builtin(model, comm_hook_type)

        @functools.wraps(orig_pre_forward)
        def _pre_forward(model: Any, *inputs: Any, **kwargs: Any) -> Any:
            st = model.__dict__.get(_ATTR)
            if st is None or not st.checked:
                hooks._first_forward(model)
            return orig_pre_forward(model, *inputs, **kwargs)

        self._patch(DDP, "register_comm_hook", register_comm_hook)
        self._patch(DDP, "_register_builtin_comm_hook", _register_builtin_comm_hook)
        self._patch(DDP, "_pre_forward", _pre_forward)

    def uninstall(self) -> None:
        self.active = False
        for obj, name, orig in reversed(self._patches):
            setattr(obj, name, orig)
        self._patches.clear()

    def _patch(self, cls: Any, name: str, new: Any) -> None:
        self._patches.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, new)

    def _not_measured(self, why: str) -> None:
        self.unmeasured.append(why)
        warn_once(f"comm.unmeasured.{why}", "DDP communication is not measured on this model: %s", why)

    # -- the lazy default hook ----------------------------------------------------------------

    def _first_forward(self, model: Any) -> None:
        st = _state(model)
        st.checked = True
        if not self.active:
            return
        try:
            self.models.add(model)
            if getattr(model, "device_type", "cpu") == "cuda":
                model.register_forward_hook(self._forward_end)
            if st.user_hook or st.builtin is not None:
                return
            if model._comm_hooks or _logged_hook_name(model):
                self._not_measured("a comm hook was registered before stepwatch started")
                return
            if getattr(model, "_use_python_reducer", False):
                self._not_measured("DDP runs its Python reducer (compiled autograd)")
                return
            pg = model.process_group
            n = pg.size()
            if model.gradient_as_bucket_view and not _is_pow2(n):
                # DDP's builtin path scales each gradient by 1/n while copying it into the bucket,
                # or divides the bucket in place when the gradient already is a view of it; a hook
                # cannot tell which happened, and for n not a power of two the two round differently.
                self._not_measured(
                    f"gradient_as_bucket_view=True with world size {n} (not a power of two): a "
                    "Python hook could change the last bit of the gradients; register a comm hook "
                    "(e.g. default_hooks.allreduce_hook) to have it measured"
                )
                return
            slot: list[Any] = [_mean_allreduce_hook, pg]
            shim = self._shim(model, slot)
            st.shim_slot = slot
            # Straight to the reducer: this is not the user's registration (no logger name, no
            # _comm_hooks entry, which only the compiled-autograd path reads).
            import torch.distributed as dist

            dist._register_comm_hook(model.reducer, None, shim)
        except Exception as e:
            st.shim_slot = None
            self._on_error("comm.ddp_first_forward", e)

    def _forward_end(self, module: Any, args: Any, out: Any) -> None:
        """CUDA: the end of the DDP forward on the compute stream starts the backward compute."""
        import torch

        if not self.active or not self.collector.enabled or not torch.is_grad_enabled():
            return
        try:
            if torch.cuda.is_current_stream_capturing():
                return  # an event recorded in a graph capture cannot be queried later
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.collector.set_forward_end_event(ev)
        except Exception as e:
            self.collector.enabled = False
            self._on_error("comm.forward_end", e)

    def _shim(self, model: Any, slot: list[Any]) -> Callable:
        timed = self._timer(model)

        def stepwatch_comm_hook(state: object, bucket: Any) -> Any:
            hook, hstate = slot[0], slot[1]
            return timed(hook, hstate, bucket)

        return stepwatch_comm_hook

    def _python_equivalent(self, comm_hook_type: Any) -> Callable | None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            return _mean_allreduce_hook
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            return default_hooks.fp16_compress_hook
        return None

    # -- wrapping a user's hook ----------------------------------------------------------------

    def wrap(self, model: Any, hook: Callable) -> Callable:
        timed = self._timer(model)

        @functools.wraps(hook)  # DDP checks the hook's signature and name: keep the user's
        def wrapped(state: object, bucket: Any) -> Any:
            return timed(hook, state, bucket)

        return wrapped

    def _timer(self, model: Any) -> Callable:
        col = self.collector
        hooks = self
        ref = weakref.ref(model)

        def timed(hook: Callable, state: object, bucket: Any) -> Any:
            if not hooks.active or not col.enabled or not hasattr(bucket, "buffer"):
                return hook(state, bucket)  # compiled-autograd path passes (grad, param) tuples
            try:
                span = hooks._begin(ref, hook, bucket)
            except Exception as e:
                col.enabled = False
                hooks._on_error("comm.ddp_hook", e)
                return hook(state, bucket)
            fut = hook(state, bucket)  # the user's hook: its errors are the user's
            try:
                fut.add_done_callback(functools.partial(hooks._done, span))
            except Exception as e:
                span.failed = True
                hooks._on_error("comm.ddp_hook", e)
            span.t_ret = _now()
            return fut

        return timed

    def _begin(self, ref: Any, hook: Callable, bucket: Any) -> Span:
        buf = bucket.buffer()
        model = ref()
        pg = model.process_group if model is not None else None
        world = pg.size() if pg is not None else 1
        name = getattr(hook, "__name__", "hook")
        # Bytes on the wire are known only for a plain AllReduce of the bucket.
        plain = hook is _mean_allreduce_hook or name == "allreduce_hook"
        nbytes = buf.numel() * buf.element_size() if plain else None
        span = self.collector.begin(ALLREDUCE, nbytes, world, name, group=group_key(pg))
        if buf.is_cuda:
            import torch

            if torch.cuda.is_current_stream_capturing():
                return span  # events recorded in a graph capture cannot be queried: host clock only
            span.ev0 = torch.cuda.Event(enable_timing=True)
            span.ev0.record()
            span.device = buf.device.index
        return span

    def _done(self, span: Span, fut: Any) -> None:
        try:
            if span.ev0 is not None:
                import torch

                ev = torch.cuda.Event(enable_timing=True)
                ev.record()  # callbacks of a CUDA future run with its streams current
                span.ev1 = ev
            self.collector.end(span)
        except Exception as e:
            span.failed = True
            self._on_error("comm.ddp_done", e)


def _logged_hook_name(model: Any) -> str | None:
    """The hook DDP's logger recorded (set by both register_comm_hook and the builtin path)."""
    try:
        return model._get_ddp_logging_data().get("comm_hook") or None
    except Exception:
        return None


def _mean_allreduce_hook(state: Any, bucket: Any) -> Any:
    """Sum-AllReduce of the bucket, scaled by 1/n exactly as DDP's builtin path does.

    DDP without a hook multiplies each gradient by ``1. / div_factor`` while copying it into the
    bucket (reducer.cpp ``mark_variable_ready_dense``: ``at::mul_out(bucket_view, grad,
    wrapped_scalar_tensor(1. / div_factor_))``); torch's Python ``allreduce_hook`` divides instead,
    which rounds differently when n is not a power of two. ``mul_`` by the same double keeps the
    gradients bit-identical to running without stepwatch.
    """
    import torch.distributed as dist

    pg = state if state is not None else dist.group.WORLD
    buf = bucket.buffer()
    buf.mul_(1.0 / pg.size())
    fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])

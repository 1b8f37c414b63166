"""FSDP2 (``fully_shard``) collectives: the all-gathers and reduce-scatters it issues.

FSDP2 has no comm-hook API for timing. It issues its collectives through the public
``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (older torch:
``all_gather_into_tensor`` / ``reduce_scatter_tensor``), looked up on the module at call time, so
stepwatch wraps those four functions. What is measured (see docs/comm.md):

- start: the call (the collective is enqueued); end: completion of the returned work's future
  (``async_op=True``, FSDP's case) or the call's return (synchronous call);
- bytes: the gathered output (all-gather) or the input being reduced (reduce-scatter).

How much of it the training thread waited for is timed by blocked.py, not here: FSDP2 waits
inside its own module hooks (``work.wait()`` in its pre-forward / pre-backward) and checks that
the work is a ``torch.distributed.Work``, so the work object is not wrapped; ``Work.wait`` is
patched on the class instead, and blocked.py's wrappers sit above these (a synchronous call, as
FSDP2 makes on gloo, blocks from call to return). Records of steps with host-timed FSDP
collectives carry that as ``comm_exposed_s``; no overlap (it is DDP's AllReduce measure).

Any caller of these four functions is timed (not only FSDP): they are collectives all the same.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

from .spans import ALL_GATHER, REDUCE_SCATTER, THIS_STEP, CommCollector, group_key, step_part

# (function name, span kind, which tensor's bytes: "out" for the gathered output, "in" for the input)
_FUNCS = (
    ("all_gather_single", ALL_GATHER, 0),
    ("all_gather_into_tensor", ALL_GATHER, 0),
    ("reduce_scatter_single", REDUCE_SCATTER, 1),
    ("reduce_scatter_tensor", REDUCE_SCATTER, 1),
)


class CollectivePatches:
    """``tracker``: the session's step tracker. A call on its training thread is kept in the step
    :func:`spans.step_part` says (none before the first step, inside a fetch, a checkpoint; held
    in an evaluation span; after the step's end the next step's), as blocked.py's intervals are;
    a call on another thread (the autograd engine's) is the step's running now."""

    def __init__(self, collector: CommCollector, on_error: Callable[[str, BaseException], None],
                 tracker: Any = None) -> None:
        self.collector = collector
        self.tracker = tracker
        self._on_error = on_error
        self._patches: list[tuple[Any, str, Any]] = []
        self.active = True

    def install(self) -> None:
        import torch.distributed as dist

        for name, kind, which in _FUNCS:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._patches.append((dist, name, orig))
            setattr(dist, name, self._wrap(orig, kind, which))

    def uninstall(self) -> None:
        self.active = False
        for mod, name, orig in reversed(self._patches):
            setattr(mod, name, orig)
        self._patches.clear()

    def _wrap(self, orig: Callable, kind: str, which: int) -> Callable:
        col = self.collector
        me = self
        try:  # where ``group`` sits when passed by position: all_gather_into_tensor(out, in, group)
            group_at = list(inspect.signature(orig).parameters).index("group")
        except (ValueError, TypeError):
            group_at = -1

        @functools.wraps(orig)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not me.active or not col.enabled:
                return orig(*args, **kwargs)
            span = None
            try:
                span = me._begin(kind, which, args, kwargs, group_at)
            except Exception as e:
                col.enabled = False
                me._on_error("comm.fsdp", e)
            work = orig(*args, **kwargs)
            if span is not None:
                me._attach(span, work)
            return work

        return collective

    def _begin(self, kind: str, which: int, args: tuple, kwargs: dict, group_at: int = -1) -> Any:
        import torch.distributed as dist

        keys = ("output_tensor", "output") if which == 0 else ("input_tensor", "input")
        t = args[which] if len(args) > which else next((kwargs[k] for k in keys if k in kwargs), None)
        nbytes = t.numel() * t.element_size() if t is not None else None
        group = args[group_at] if 0 <= group_at < len(args) else kwargs.get("group")
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        tr = self.tracker
        part = step_part(tr) if tr is not None and threading.get_ident() == tr._thread else THIS_STEP
        span = self.collector.begin(kind, nbytes, world, kind, group=group_key(group), part=part)
        if t is not None and t.is_cuda:
            import torch

            if torch.cuda.is_current_stream_capturing():
                return span  # events recorded in a graph capture cannot be queried: host clock only
            span.ev0 = torch.cuda.Event(enable_timing=True)
            span.ev0.record()
            span.device = t.device.index
        return span

    def _attach(self, span: Any, work: Any) -> None:
        try:
            if work is None:  # synchronous call: complete on return (host) / on the stream (CUDA)
                self._done(span, None)
                return
            work.get_future().add_done_callback(functools.partial(self._done, span))
        except Exception:
            # A backend without futures for this op: the span cannot be closed truthfully.
            span.failed = True

    def _done(self, span: Any, fut: Any) -> None:
        try:
            if span.ev0 is not None:
                import torch

                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                span.ev1 = ev
            self.collector.end(span)
        except Exception as e:
            span.failed = True
            self._on_error("comm.fsdp_done", e)

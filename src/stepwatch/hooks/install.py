"""Wire the step tracker into PyTorch without a code change in the training script.

What is hooked, and why this way:
- Optimizer steps: torch's *global* optimizer step pre/post hooks (every optimizer, no wrapping).
  A closure passed to ``step(closure)`` is handed on wrapped (the pre-hook may replace arguments),
  so the closure's time stays out of ``optimizer_s`` and observers see the grads it made.
- Backward: ``torch.autograd.backward`` (what ``Tensor.backward`` calls), replaced by a timing wrapper,
  and ``torch.autograd.grad`` (a manual update from it, a gradient penalty), except inside a root
  forward (a loss that takes input gradients there is part of that forward).
- Data wait: ``_BaseDataLoaderIter.__next__`` (single- and multi-process DataLoader iterators), on
  the training thread only (another thread's fetch, a prefetcher's, passes through); with grad
  disabled it is evaluation. ``DataLoader.__iter__``'s start is told to the tracker: an
  evaluation's span starts where its iterator (and its workers) did.
- GradScaler: ``torch.amp.GradScaler.step``, to see a step the scaler skips.
- Checkpoints: ``torch.save``, ``torch.distributed.checkpoint``'s save functions, safetensors'
  ``save_file``/``save_model`` and transformers' ``save_pretrained`` (Hugging Face's format), on
  the training thread (a save on another thread runs alongside the steps: not timed). The last
  three are patched once the user has imported their module (never imported for this): at
  install, or as that import finishes (``_imports.ImportWatch``).
- Forward: only the *root* modules (modules that are nobody's child: the DDP wrapper, the
  ``torch.compile`` wrapper, a loss module). Global per-module hooks cost 190-370 us per forward
  on a 49-module GPT and make torch.compile guard on them, so roots are found once by scanning
  the live modules (``gc``) at ``init`` and when training starts. A root's call is wrapped, not hooked:
  ``Module.__call__`` runs the instance's ``_compiled_call_impl`` when one is set, and a
  ``_RootCall`` there times the module's ``_call_impl`` around it, so the module keeps torch's
  no-hook fast path (forward hooks, even no-ops, send every call down the slow one). A module
  compiled in place (``model.compile()``, before or after the scan) has its compiled callable
  wrapped instead, so timing stays outside compiled code. A ``torch.compile``'d *function* that
  calls the model (``@torch.compile def train_step(x, y)``) inlines the model's call, which its
  ``_compiled_call_impl`` never sees: the function's dynamo context gets an enter hook instead
  (``_CompiledCall``; ``OptimizeContext.__call__`` wrapped, and the contexts made before ``init``
  found by its scan), which tells the tracker of each call made at the top of the loop
  (``StepTracker.compiled_begin``). Framework adapters may
  declare more roots, or wrappers that are not model calls (:meth:`Instrumentation.declare_roots`).
  ``init`` scans, and so does the first optimizer's construction (``Optimizer.__init__``,
  wrapped): a loop without a DataLoader has its roots hooked before its first forward, whether
  the model was built before ``init`` or after, so step 0 counts every micro-batch (a global
  module hook would do it for loops without an optimizer too, but torch.compile traces global
  hooks, and it would cost every module call until it fired). A root called inside a DataLoader
  fetch (an ``nn.Module`` transform in ``Dataset.__getitem__``) is data loading: its calls are
  not timed or observed. A root called again inside a backward (the recompute of
  ``checkpoint(model, x)``) is backward time. ``torch.utils.checkpoint.checkpoint_sequential``,
  which calls a model's layers and never the model, is wrapped: given a root, the call is that
  root's forward (not seen when the script imported the function before ``init``).
  A heap frozen by ``gc.freeze()`` hides what it froze from ``gc.get_objects()``: then the scan
  also walks the references from the calling frames' locals and ``__main__`` (:func:`_reachable`).
- No optimizer: when no ``torch.optim.Optimizer`` exists at the first backward (or
  ``autograd.grad``), each one ends a step (``tracker.boundary = "backward"``, named in
  ``run.json``), and one line says so.

- Pickling: ``nn.Module.__getstate__`` (what ``torch.save(model)``, ``pickle`` and ``copy.deepcopy``
  take) leaves the wrapped call out, and a module with its own ``__getstate__`` pickles the
  ``_RootCall`` as None, so a copy or a loaded model is never timed.

Everything is undone by :meth:`Instrumentation.uninstall`.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable

from .._imports import ImportWatch
from .phases import FETCH_END, FETCH_NO_GRAD, Collector, StepTracker
from .replay import is_replay_module

_get_ident = threading.get_ident

# Bounded number of root scans (each is one pass over the garbage collector's objects): scans that
# hook no new root count toward MAX_SCANS; a scan that finds a new model (the next fold of a
# cross-validation, the next model of a sweep) does not, up to MAX_ALL_SCANS in all.
MAX_SCANS = 8
MAX_ALL_SCANS = 256

# A loop that runs backward but calls no root (its model's methods call the submodules:
# ``agent.get_action_and_value(obs)``, ``model.forward(x)``) gets the roots' submodules hooked as
# roots, a level further down at each such step (a method looping over a ModuleList: 2 levels),
# up to DESCEND_LEVELS; a level of more than DESCEND_MAX modules is not taken (``_UnseenForward``).
DESCEND_LEVELS = 3
DESCEND_MAX = 64

# The savers' modules, patched once the user imports them (``Instrumentation._patch_savers``).
SAVER_MODULES = ("torch.distributed.checkpoint", "safetensors.torch", "transformers.modeling_utils")
# Where torch.compile's wrapper module lives (imported at the first torch.compile, not with torch).
DYNAMO_MODULE = "torch._dynamo.eval_frame"


class Instrumentation:
    def __init__(self, tracker: StepTracker, on_error: Callable[[str, BaseException], None]) -> None:
        self.tracker = tracker
        self._on_error = on_error
        self._patches: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self._hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # Roots whose call is wrapped: (weak module, its _RootCall, what _compiled_call_impl was).
        self._calls: list[tuple[Any, Any, Any]] = []
        self._seen_optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # those that stepped
        # Roots an optimizer in _seen_optimizers steps (_trained): module -> (how many, whether)
        self._trained_roots: "weakref.WeakKeyDictionary[Any, tuple[int, bool]]" = weakref.WeakKeyDictionary()
        self._scanned_optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # a scan ran when it was made
        self._last_optimizer: "weakref.ref[Any] | None" = None  # the one that stepped last
        self._scans = 0  # scans that found no new root
        self._all_scans = 0
        self._optimizers_alive = False  # the last scan saw a torch.optim.Optimizer of a root's parameters
        self._optimizers_exist = False  # the last scan saw one at all
        self._boundary_checked = False
        self._data_scanned = False
        self._dcp_patched = False
        self._st_patched = False
        self._hf_patched = False
        self._wrapper_patched = False  # torch.compile's OptimizedModule.__init__ (_patch_compiled_wrapper)
        # torch.compile'd functions (_patch_compiled_functions): the dynamo contexts given an enter
        # hook (context -> its _CompiledCall), whether the next scan looks for contexts made before
        # the patch, and the depth of torch.compile(module) calls (whose context is a root's).
        self._fn_patched = False
        self._fn_contexts: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self._contexts_due = False
        self._compiling_module = 0
        self._eval_roots: tuple[Any, list[Any]] | None = None  # _trained_in_eval's roots, and when
        self._compiled_said = False  # _compiled_unseen's line
        self._compiled_col: _CompiledForward | None = None  # rootless_compiled's collector
        self._import_watch: ImportWatch | None = None  # _watch_imports
        # The bytes of the saves inside one that reports what its saves wrote (save_pretrained's
        # safetensors files); None when no such save is open.
        self._save_sums: list[int | None] | None = None
        self.scan_s = 0.0
        self._copy_scan_due = False  # a root was copied: a scan at the next step's end (_root_copied)
        self.roots: list[str] = []
        # Features that want each root forward call (module, args, kwargs) or each optimizer step
        # (optimizer), on the training thread, before the phase opens.
        self.forward_observers: list[Callable[[Any, Any, Any], None]] = []
        self.optimizer_observers: list[Callable[[Any], None]] = []
        # Features that want the gradients of a loop without a torch optimizer, at the end of each
        # outermost backward (before the loop's own update): ``fn(params)``, ``params`` shaped as
        # an optimizer (``_RootParams``). Set up at the first backward (``_observe_manual_updates``).
        self.manual_update_observers: list[Callable[[Any], None]] = []
        self._backward: Any = None  # the wrapped torch.autograd.backward (_Backward)
        # Features that want to know when a closure is evaluated again inside one optimizer step
        # (LBFGS, line searches): ``fn(True)`` before such a call, ``fn(False)`` after it.
        self.reevaluation_observers: list[Callable[[bool], None]] = []
        # Features that want each root call inside a backward (module, args, kwargs): the recompute
        # of a root checkpointed from the loop. Such a call is no forward of the step.
        self.recompute_observers: list[Callable[[Any, Any, Any], None]] = []
        # A reentrant checkpoint's forward (``checkpoint(model, x, use_reentrant=True)``) calls the
        # root without grad from this code: that call is the step's forward (_checkpointed_forward).
        self._ckpt_code: Any = None  # set at install
        # Features that want an exception passing through a hooked phase (phase name, exception),
        # on the training thread, before it propagates unchanged (OOM forensics).
        self.exception_observers: list[Callable[[str, BaseException], None]] = []
        # Modules a framework adapter declared not to be model calls (ids; see ``declare_roots``).
        self._not_roots: set[int] = set()
        # Called (training thread) when this process launches processes with torch.multiprocessing's
        # spawn/start_processes, before they start (the session's launcher stand-down).
        self.on_launch: Callable[[], None] | None = None

    # -- install / uninstall ----------------------------------------------------------------

    def install(self) -> None:
        import torch
        import torch.optim.optimizer as optim_mod
        from torch.utils.data import dataloader

        tr = self.tracker
        self._handles.append(optim_mod.register_optimizer_step_pre_hook(_OptPre(self)))
        # The tracker's own method, no frame of ours between (it takes and ignores the hook's
        # (optimizer, args, kwargs)).
        self._handles.append(optim_mod.register_optimizer_step_post_hook(tr.optimizer_end))

        self._backward = _Backward(self, torch.autograd.backward)
        self._patch(torch.autograd, "backward", self._backward)
        self._patch(torch.autograd, "grad", _Grad(self, torch.autograd.grad))
        ckpt = torch.utils.checkpoint
        self._patch(ckpt, "checkpoint_sequential", _checkpoint_sequential(self, ckpt.checkpoint_sequential))
        # A reentrant checkpoint's forward calls the root without grad from here (_checkpointed_forward).
        self._ckpt_code = getattr(getattr(getattr(ckpt, "CheckpointFunction", None), "forward", None), "__code__", None)

        it_cls = dataloader._BaseDataLoaderIter
        self._patch(it_cls, "__next__", _DataNext(self, it_cls.__next__))
        self._patch(dataloader.DataLoader, "__iter__", _timing_iter(tr, dataloader.DataLoader.__iter__))
        workers_cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
        if workers_cls is not None:
            self._patch(workers_cls, "__init__", _marking_workers(workers_cls.__init__))

        scaler_cls = torch.amp.GradScaler
        orig_scaler_step = scaler_cls.step

        @functools.wraps(orig_scaler_step)
        def scaler_step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = tr.scaler_begin()
            try:
                out = orig_scaler_step(scaler, *args, **kwargs)
            finally:
                tr.scaler_end(t0)
            optimizer = args[0] if args else kwargs.get("optimizer")
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                try:
                    tr.mark_skipped(_found_inf(scaler, optimizer))
                except Exception as e:  # never raise into the training loop
                    self._on_error("hooks.scaler_found_inf", e)
            return out

        self._patch(scaler_cls, "step", scaler_step)

        orig_save = torch.serialization.save
        wrapped_save = self._checkpoint_wrapper(orig_save, file_arg=1)
        self._patch(torch.serialization, "save", wrapped_save)
        self._patch(torch, "save", wrapped_save)
        self._patch_savers()
        opt_cls = torch.optim.Optimizer
        orig_init = opt_cls.__init__

        @functools.wraps(orig_init)
        def optimizer_init(opt: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(opt, *args, **kwargs)
            if tr.enabled:
                # The model exists once an optimizer holds its parameters: hook its roots before
                # the first forward (a loop without a DataLoader would miss step 0's first). Each
                # new optimizer (maybe of a new model: the next fold, a reloaded one) scans; its
                # first step then has nothing new to look for.
                try:
                    self._scanned_optimizers.add(opt)
                    self._scan("new optimizer")
                except Exception as e:
                    self._on_error("hooks.discovery", e)

        self._patch(opt_cls, "__init__", optimizer_init)

        # torch.save(model) / pickle / copy.deepcopy of a hooked module: the state they take
        # leaves stepwatch's root hooks out, so the pickle names nothing of stepwatch and a copy
        # or a loaded model carries no hooks. The module itself is not touched.
        orig_getstate = torch.nn.Module.__getstate__

        @functools.wraps(orig_getstate)
        def __getstate__(module: Any) -> Any:
            if isinstance(getattr(module, "__dict__", {}).get("_compiled_call_impl"), _RootCallBase):
                self._root_copied()
            return _without_root_hooks(orig_getstate(module))

        self._patch(torch.nn.Module, "__getstate__", __getstate__)

        # model.compile() after its root was hooked replaces the wrapped call: wrap the new one.
        orig_compile = torch.nn.Module.compile

        @functools.wraps(orig_compile)
        def compile(module: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig_compile(module, *args, **kwargs)
            try:
                self._rewrap_compiled(module)
            except Exception as e:
                self._on_error("hooks.compile", e)
            return out

        self._patch(torch.nn.Module, "compile", compile)
        self._patch_compiled_wrapper()
        self._watch_imports()
        self._patch_launch()
        unseen = _UnseenForward(self)
        tr.collectors.append(unseen)
        tr.listeners.append(unseen.step_ended)
        # A model (and its optimizer) built before stepwatch.init(): its roots are hooked now, so a
        # loop without a DataLoader times and counts step 0's first forward too (the scans at the
        # first optimizer, data fetch and backward come after that forward).
        self._scan("init")

    def _patch_launch(self) -> None:
        """``torch.multiprocessing.spawn`` calls its module's ``start_processes``, which the package
        exports too: both are wrapped to tell ``on_launch`` first."""
        mod = sys.modules.get("torch.multiprocessing.spawn")
        orig = getattr(mod, "start_processes", None)
        if orig is None:
            return

        @functools.wraps(orig)
        def start_processes(*args: Any, **kwargs: Any) -> Any:
            if self.on_launch is not None:
                try:
                    self.on_launch()
                except Exception as e:
                    self._on_error("hooks.launch", e)
            return orig(*args, **kwargs)

        import torch.multiprocessing as tmp

        self._patch(mod, "start_processes", start_processes)
        if getattr(tmp, "start_processes", None) is orig:
            self._patch(tmp, "start_processes", start_processes)

    def _check_boundary(self) -> None:
        """First backward: find the roots if no scan ran yet, and whether the loop has a torch
        optimizer at all; without one, each backward ends a step."""
        self._boundary_checked = True
        # The thread of the first backward trains (Ray Train runs the loop on a thread of its own,
        # not the one that imported stepwatch): other threads' fetches and saves are not the steps'.
        self.tracker._thread = threading.get_ident()
        # Always (not only when no scan ran yet): the first module call may have come before the
        # model was built.
        self._scan("first backward")
        if self._optimizers_alive and not self._seen_optimizers and not len(self._scanned_optimizers):
            # Every optimizer of a root was made before this session: maybe garbage a cycle keeps
            # (an earlier model and its optimizer, held by a traceback), which made a loop without
            # an optimizer one with no step at all. Collected once, then looked for again.
            t0 = time.perf_counter()
            gc.collect()
            self.tracker.exclude(int((time.perf_counter() - t0) * 1e9))
            self._scan("first backward, after a collection")
        tr = self.tracker
        if not self._optimizers_alive and not self._seen_optimizers and tr.boundary == "optimizer":
            tr.boundary = "backward"
            from .._log import logger

            if self._optimizers_exist:
                # Functional training (torch.func.functional_call over a dict of tensors that an
                # optimizer updates), or an optimizer of something else: not a missing optimizer.
                logger.info(
                    "stepwatch: no torch.optim optimizer holds the model's parameters yet; each "
                    "backward ends a step until an optimizer steps (call stepwatch.step() after "
                    "your update to mark steps yourself)"
                )
            else:
                logger.warning(
                    "stepwatch: no torch.optim optimizer in this process; each backward ends a step "
                    "(call stepwatch.step() after your update to mark steps yourself)"
                )
        if not self._optimizers_alive and not self._seen_optimizers and self.manual_update_observers:
            self._observe_manual_updates()

    def _observe_manual_updates(self) -> None:
        """A loop without a torch optimizer (its first backward is running): from this backward
        on, the end of each outermost one calls ``manual_update_observers`` with the roots'
        parameters, until an optimizer steps. torch's backward inside our wrapper is wrapped
        once more, here (the wrapper reads ``inner`` after this check, so this backward counts
        too); no extra call in a loop with an optimizer."""
        bw = self._backward
        if bw is None:
            return
        inner = bw.inner
        tr = self.tracker
        params = _RootParams()
        params.mark(self)

        @functools.wraps(inner)
        def backward(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if tr._bwd_depth == 1 and tr.enabled and not self._seen_optimizers:
                try:
                    params.refresh(self)
                except Exception as e:
                    self._on_error("hooks.discovery", e)
                    return out
                for fn in self.manual_update_observers:
                    try:
                        fn(params)
                    except Exception as e:
                        self._drop_observer("manual_update", fn, e)
            return out

        bw.inner = backward

    def uninstall(self) -> None:
        if self._import_watch is not None:
            self._import_watch.stop()
        self._unwrap_calls()
        for ctx, call in list(self._fn_contexts.items()):
            hooks = getattr(ctx, "enter_exit_hooks", None)
            if type(hooks) is list:
                hooks[:] = [h for h in hooks if h is not call]
        self._fn_contexts.clear()
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # a handle whose module is gone
                pass
        self._handles.clear()
        for obj, name, orig in reversed(self._patches):
            if orig is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, orig)
        self._patches.clear()

    def _patch(self, obj: Any, name: str, new: Any) -> None:
        orig = obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)
        self._patches.append((obj, name, orig))
        setattr(obj, name, new)

    def _checkpoint_wrapper(self, orig: Callable[..., Any], *, file_arg: int | None = None, file_kw: str = "f",
                            inner_bytes: bool = False, futures: bool = False) -> Callable[..., Any]:
        """Time a save. Its bytes: for a save to a file (``torch.save``, safetensors' ``save_file``:
        the argument ``file_arg``, or ``file_kw``), the file's size or the file object's advance;
        for one that writes through such saves (``inner_bytes``: ``save_pretrained``), the sum of
        theirs; else unknown (``torch.distributed.checkpoint``). ``futures``: the save returns
        futures (``async_save``) whose waits are checkpoint time too (:class:`_TimedWait`)."""
        tr = self.tracker
        import torch

        storages = (torch.storage._StorageBase, torch.storage.TypedStorage)

        @functools.wraps(orig)
        def save(*args: Any, **kwargs: Any) -> Any:
            if _get_ident() != tr._thread:
                # A save on another thread (checkpointing in the background) runs alongside the
                # steps, which do not wait for it: no step's time, and it ends none.
                return orig(*args, **kwargs)
            if file_arg is not None and args and isinstance(args[0], storages) and kwargs.get(
                    "_use_new_zipfile_serialization") is False:
                # A storage's own __reduce__: pickling a tensor (pickle.dumps, all_gather_object)
                # saves each storage into a BytesIO. No checkpoint; torch.save(model) never does it.
                return orig(*args, **kwargs)
            if _communicates(sys._getframe(1)):
                # torch.distributed's own save to send an object (ZeroRedundancyOptimizer's
                # consolidate_state_dict): communication on the sending ranks only, no checkpoint
                # (it made a tail record on rank 1 and none on rank 0).
                return orig(*args, **kwargs)
            t0 = tr.checkpoint_begin()
            sums = self._save_sums  # an open save that sums its saves' bytes, when this is inside it
            f = None
            if file_arg is not None and (t0 or sums is not None):
                f = args[file_arg] if len(args) > file_arg else kwargs.get(file_kw)
            start = _position(f)
            summing = inner_bytes and bool(t0)
            if summing:
                self._save_sums = []
            saved = False
            try:
                out = orig(*args, **kwargs)
                saved = True
                if futures:
                    _time_waits(out, tr)
                return out
            finally:
                if summing:
                    inner, self._save_sums = self._save_sums, sums
                    # none written (another rank's shards), or one unknown: unknown
                    nbytes = sum(inner) if saved and inner and None not in inner else None  # type: ignore[arg-type]
                else:
                    # A save that raised wrote what it wrote: unknown, not the size of the file
                    # an earlier save left at that path (a refused safetensors save, a read-only
                    # disk, were credited with the old file's bytes at tens of GB/s).
                    nbytes = _written(f, start) if saved else None
                    if not t0 and sums is not None and not inner_bytes:  # a summing one's add up there
                        sums.append(nbytes)
                tr.checkpoint_end(t0, nbytes)

        return save

    def _patch_savers(self) -> None:
        """The savers of libraries that load only when the user imports them (never imported for
        this): looked for at install, and after that as each of their modules is imported
        (``_watch_imports``)."""
        self._patch_dcp()
        self._patch_safetensors()
        self._patch_save_pretrained()

    def _watch_imports(self) -> None:
        """A module patched here that is imported later is patched as its import finishes, before
        the importer binds its names (``_imports.ImportWatch``, one for all of them): a saver's (a
        save helper's own ``from safetensors.torch import save_file``, ``import
        torch.distributed.checkpoint`` at the first save), and torch.compile's wrapper (its module
        loads at the first ``torch.compile``)."""
        self._import_watch = ImportWatch(SAVER_MODULES + (DYNAMO_MODULE,), self._module_imported).start()

    def _module_imported(self, name: str) -> None:
        compile_ = name == DYNAMO_MODULE
        try:
            if compile_:
                self._patch_compiled_wrapper()
            else:
                self._patch_savers()
        except Exception as e:  # never raise into the user's import
            self._on_error("hooks.compile" if compile_ else "hooks.saver_import", e)

    def _patch_dcp(self) -> None:
        """Patch torch.distributed.checkpoint's savers if the user imported it (it is heavy)."""
        if self._dcp_patched:
            return
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is None:
            return
        self._dcp_patched = True
        for name in ("save", "async_save", "save_state_dict"):
            fn = getattr(dcp, name, None)
            if callable(fn):
                self._patch(dcp, name, self._checkpoint_wrapper(fn, futures=name == "async_save"))

    def _patch_safetensors(self) -> None:
        """safetensors' ``save_file`` and ``save_model`` (Hugging Face's weights format: what
        ``save_pretrained``, the Trainer and Accelerate's ``save_model`` write through), if the
        user imported ``safetensors.torch``. Libraries import ``save_file`` by name (transformers'
        and accelerate's ``from safetensors.torch import save_file as safe_save_file``) and hold
        the function itself: every loaded module's name for it is patched too, in one pass over
        ``sys.modules`` (~20 ms with transformers loaded, once, kept out of the step's time); a
        module imported later takes the patched one."""
        if self._st_patched:
            return
        st = sys.modules.get("safetensors.torch")
        if st is None:
            return
        self._st_patched = True
        t0 = time.perf_counter()
        try:
            wrapped: dict[int, tuple[Any, Any]] = {}
            for name in ("save_file", "save_model"):
                fn = getattr(st, name, None)
                if callable(fn):
                    wrapped[id(fn)] = (fn, self._checkpoint_wrapper(fn, file_arg=1, file_kw="filename"))
            for mod in list(sys.modules.values()):
                if not isinstance(mod, types.ModuleType):
                    continue
                for k, v in list(mod.__dict__.items()):
                    w = wrapped.get(id(v))
                    if w is not None and w[0] is v:
                        self._patch(mod, k, w[1])
        except Exception as e:
            self._on_error("hooks.safetensors", e)
        finally:
            self.tracker.exclude(int((time.perf_counter() - t0) * 1e9))

    def _patch_save_pretrained(self) -> None:
        """transformers' ``PreTrainedModel.save_pretrained`` as one save, if the user imported
        transformers' models: its own work around the safetensors writes (the weights' renaming
        back to the checkpoint's names: 66 of a first save's 71 ms for a small GPT-2 on CPU) is
        the checkpoint's too. Its bytes are those of its safetensors files."""
        if self._hf_patched:
            return
        mu = sys.modules.get("transformers.modeling_utils")
        cls = getattr(mu, "PreTrainedModel", None) if mu is not None else None
        if not isinstance(cls, type):
            return
        self._hf_patched = True
        fn = cls.__dict__.get("save_pretrained")
        if callable(fn):
            self._patch(cls, "save_pretrained", self._checkpoint_wrapper(fn, inner_bytes=True))

    # -- optimizer hooks --------------------------------------------------------------------------

    def _opt_pre_args(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        """The pre-hook's path when ``optimizer.step`` got more than ``self`` (it may hold a
        closure), from the last optimizer check on (``_PyOptPreCore``)."""
        tr = self.tracker
        result = None
        closure = _closure_arg(args, kwargs)
        if closure is None:
            if self.optimizer_observers:
                self._observe_optimizer(optimizer)
        else:
            # optimizer.step(closure) (Lightning, LBFGS): forward and backward run inside step();
            # the closure is kept out of optimizer_s, and the gradients exist only once it has
            # run, so the observers see them right after its first call. The closure is the
            # iteration's work: a step the last optimizer left pending ends here (a loop with
            # nothing outside the closure, as LBFGS's is written, would otherwise be one step).
            tr.work_begins()
            try:
                result = _with_closure(args, kwargs, self._wrap_closure(closure, optimizer))
            except Exception as e:
                self._on_error("hooks.closure", e)
        tr.optimizer_begin()
        return result

    def _new_optimizer(self, optimizer: Any) -> None:
        """An optimizer other than the last one steps: the first step of one never seen scans."""
        try:
            self._last_optimizer = weakref.ref(optimizer)
        except TypeError:  # not weak-referenceable: asked again each step
            self._last_optimizer = None
        if optimizer not in self._seen_optimizers:
            try:
                self._seen_optimizers.add(optimizer)
                if optimizer not in self._scanned_optimizers:  # made before stepwatch started
                    self._scan("new optimizer")
            except Exception as e:
                self._on_error("hooks.discovery", e)

    def _observe_optimizer(self, optimizer: Any) -> None:
        for fn in self.optimizer_observers:
            try:
                fn(optimizer)
            except Exception as e:
                self._drop_observer("optimizer", fn, e)

    def _wrap_closure(self, closure: Callable[..., Any], optimizer: Any) -> Callable[..., Any]:
        tr = self.tracker
        first = [True]

        @functools.wraps(closure)
        def closure_in_step(*a: Any, **k: Any) -> Any:
            paused = tr.pause_optimizer()
            again = not first[0] and bool(self.reevaluation_observers)
            if again:
                self._observe_reevaluation(True)
            try:
                out = closure(*a, **k)
                if first[0]:
                    first[0] = False
                    self._observe_optimizer(optimizer)
                return out
            finally:
                if again:
                    self._observe_reevaluation(False)
                if paused:
                    tr.resume_optimizer()

        return closure_in_step

    def _observe_reevaluation(self, begins: bool) -> None:
        for fn in self.reevaluation_observers:
            try:
                fn(begins)
            except Exception as e:
                self._drop_observer("reevaluation", fn, e)

    def _drop_observer(self, kind: str, fn: Any, exc: BaseException) -> None:
        self.remove_observer(kind, fn)
        self._on_error(f"observer.{getattr(fn, '__qualname__', fn)}", exc)

    def remove_observer(self, kind: str, fn: Any) -> None:
        """Take ``fn`` off ``<kind>_observers`` (forward, optimizer, reevaluation, exception). The
        list is replaced, not changed in place: a loop over it that is running (the observer
        removing itself) goes on over the old one and calls every other observer."""
        attr = f"{kind}_observers"
        setattr(self, attr, [f for f in getattr(self, attr) if f != fn])  # a bound method is made anew each time: equal, not identical

    def _observe_exception(self, phase: str, exc: BaseException) -> None:
        for fn in self.exception_observers:
            try:
                fn(phase, exc)
            except Exception as e:
                self._drop_observer("exception", fn, e)

    def _observe_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        for fn in self.forward_observers:
            try:
                fn(module, args, kwargs)
            except Exception as e:
                self._drop_observer("forward", fn, e)

    def _observe_recompute(self, module: Any, args: Any, kwargs: Any) -> None:
        for fn in self.recompute_observers:
            try:
                fn(module, args, kwargs)
            except Exception as e:
                self._drop_observer("recompute", fn, e)

    def _checkpointed_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """A root called without grad by a reentrant checkpoint's forward (both root-call cores
        found ``_ckpt_code`` among its callers): the step's forward, observed as one with grad
        (the observers ignored it without; the recompute in the backward is hardware work only).
        Never raises: it reports its own errors."""
        try:
            if self.forward_observers and not self.tracker._fwd_depth:
                import torch

                with torch.enable_grad():
                    self._observe_forward(module, args, kwargs)
        except Exception as e:
            self._on_error("hooks.checkpointed_forward", e)

    # -- root module discovery ------------------------------------------------------------------

    def _no_grad_call(self, mod: Any) -> None:
        """A root called without grad, its forward phase begun (both root-call cores). In eval
        mode, a model that an optimizer steps (the one being trained) is being evaluated: its span
        is evaluation, however few its calls (pytorch/examples' gcn evaluates twice a step, and the
        evaluation was the next step's forward). A frozen teacher has no stepped optimizer; in
        train mode a model labelling its own batch (FixMatch) stays the step's work."""
        tr = self.tracker
        try:
            if getattr(mod, "training", True) is not False or not tr._eval_open or tr._eval_judged:
                return
            if self._trained(mod):
                tr.eval_span_is_evaluation()
        except Exception as e:  # inside the user's forward call: never raise there
            self._on_error("hooks.eval_call", e)

    def _trained(self, mod: Any) -> bool:
        """An optimizer that has stepped holds a parameter of ``mod``: cached per module until the
        set of such optimizers changes."""
        n = len(self._seen_optimizers)
        got = self._trained_roots.get(mod)
        if got is None or got[0] != n:
            got = (n, _steps_a_root(list(self._seen_optimizers), [mod]))
            self._trained_roots[mod] = got
        return got[1]

    def declare_roots(self, model: Any = (), not_model: Any = ()) -> None:
        """For framework adapters (``stepwatch.integrations``), who know what the step calls.

        ``model``: modules the training step calls directly (a LightningModule's submodules, which
        the scan cannot see as roots because they have a parent): hooked as roots now. Calls nested
        inside another root's call are timed and observed once, as part of the outer call.
        ``not_model``: modules whose call is not a model call (Lightning's DDP wrapper runs
        ``training_step``): never hooked by a scan; hooks already on them stop timing.
        """
        for m in not_model:
            if id(m) not in self._not_roots:
                self._not_roots.add(id(m))
                # Ids are reused once an object is freed: forget the id with the module.
                weakref.finalize(m, self._not_roots.discard, id(m))
        for m in model:
            if id(m) not in self._not_roots and m not in self._hooked:
                self._hook_root(m)

    def _scan(self, why: str) -> None:
        if self._scans >= MAX_SCANS or self._all_scans >= MAX_ALL_SCANS:
            return
        self._all_scans += 1
        hooked = len(self.roots)
        t0 = time.perf_counter()
        try:
            import torch.nn as nn
            from torch.optim import Optimizer

            if not self._fn_patched and DYNAMO_MODULE in sys.modules:
                # dynamo imported with no word from the import watch (imported before it started,
                # half way, on another thread): patched now, its contexts looked for below
                self._patch_compiled_wrapper()
            objects = gc.get_objects()
            if gc.get_freeze_count():  # gc.freeze() hid the objects it froze from get_objects()
                seen = {id(o) for o in objects}
                objects += [o for o in _reachable(sys._getframe(1), (nn.Module, Optimizer)) if id(o) not in seen]
            modules, optimizers = _instances(objects, nn.Module, Optimizer)
            # stepwatch's own modules (the FLOP count's replay, alive while another thread's scan
            # runs) are neither roots nor parents: the model they hold stays a root.
            # A module whose __init__ never ran (a deepcopy or an unpickling that failed half way)
            # has no _modules: it crashed the scan, and discovery stayed off for the run.
            # A module made by torch.jit.trace has no _modules: its forward calls the script
            # module it holds (_actual_script_module), which holds the parameters and submodules.
            # That one is its child here, so the traced module, which the script calls, is the root.
            modules = [m for m in modules if _has_children_dict(m) and not is_replay_module(m)]
            if self._contexts_due:
                self._contexts_due = False
                self._hook_old_contexts(objects, modules)
            children: set[int] = set()
            for m in modules:
                for c in _children(m):
                    if c is not None:
                        children.add(id(c))
            for m in modules:
                if id(m) not in children and m not in self._hooked and id(m) not in self._not_roots:
                    self._hook_root(m)
            del objects
            self._optimizers_alive = _steps_a_root(optimizers, list(self._hooked))
            self._optimizers_exist = bool(optimizers)
        except Exception as e:
            self._on_error("hooks.discovery", e)
        finally:
            if len(self.roots) == hooked:
                self._scans += 1
            dt = time.perf_counter() - t0
            self.scan_s += dt
            self.tracker.exclude(int(dt * 1e9))

    def _root_copied(self) -> None:
        """A hooked root was copied or pickled (``copy.deepcopy(model)`` for an EMA made after
        training began, a whole-model ``torch.save``): a copy may be a new root that no scan will
        otherwise find (it has no optimizer of its own). The step's end looks, once (any thread:
        a listener list's append is atomic)."""
        if not self._copy_scan_due:
            self._copy_scan_due = True
            self.tracker.listeners.append(self._scan_after_copy)

    def _scan_after_copy(self, step: int) -> None:
        """tracker listener, one-shot (training thread, at a step's end)."""
        self._copy_scan_due = False
        self.tracker.remove_listener(self._scan_after_copy)
        self._scan("a root was copied")

    def _hook_root(self, m: Any) -> None:
        self._hooked.add(m)
        self.roots.append(type(m).__name__)
        # The root's call is timed from outside torch's hook machinery: ``Module.__call__`` runs
        # ``_compiled_call_impl`` when one is set, so a ``_RootCall`` there wraps ``_call_impl``
        # (or, after ``model.compile()``, the compiled callable: timing stays outside compiled
        # code) and the module keeps torch's fast path (a module with forward hooks takes the
        # slow one: ~5 us more per call on this project's machine, with no-op hooks).
        self._wrap_call(m)

    def _wrap_call(self, m: Any) -> None:
        before = m.__dict__.get("_compiled_call_impl", _MISSING)
        inner = before if before is not _MISSING and before is not None else m._call_impl
        call = _RootCall(self, m, inner)
        object.__setattr__(m, "_compiled_call_impl", call)
        # Weakly, the module and its call (which holds the module, and ``before`` as its
        # ``inner``): the module holds the call, and a script that drops its model (a sweep's
        # trial, a fold) gets its memory back as without stepwatch. What to put back is said,
        # not held: nothing (_MISSING), None, or the call's inner (the compiled callable).
        self._calls.append((weakref.ref(m), weakref.ref(call), before if before is _MISSING or before is None else _INNER))

    def _patch_compiled_wrapper(self) -> None:
        """``torch.compile(model)`` of a root already hooked (nanoGPT builds its optimizer, whose
        scan hooks the model, then compiles): the wrapper calls the model's ``__call__`` inside
        the compiled region, so dynamo traced stepwatch's root call: 3 graph breaks, the FLOP/token
        observer compiled and failed (samples, tokens and FLOPs null for the run), a dropout mask
        drawn elsewhere (another training result with inductor), the first training forward as
        evaluation. The wrapper becomes the root instead, as when the scan finds it (compiling
        before the optimizer): stepwatch's call runs outside compiled code, the model's own is
        torch's again."""
        self._patch_compiled_functions()
        if self._wrapper_patched:
            return
        cls = getattr(sys.modules.get(DYNAMO_MODULE), "OptimizedModule", None)
        if cls is None:
            return
        self._wrapper_patched = True
        orig = cls.__init__

        @functools.wraps(orig)
        def __init__(wrapper: Any, mod: Any, *args: Any, **kwargs: Any) -> None:
            orig(wrapper, mod, *args, **kwargs)
            try:
                if self.tracker.enabled and mod in self._hooked:
                    self._unwrap_call(mod)
                    self._hooked.discard(mod)
                    try:
                        self.roots.remove(type(mod).__name__)
                    except ValueError:
                        pass
                    self._hook_root(wrapper)
            except Exception as e:
                self._on_error("hooks.compile", e)

        self._patch(cls, "__init__", __init__)

    def _rewrap_compiled(self, m: Any) -> None:
        """``model.compile()`` on a root already hooked: time the new compiled callable."""
        now = m.__dict__.get("_compiled_call_impl")
        if now is not None and not isinstance(now, _RootCallBase) and m in self._hooked:
            self._wrap_call(m)

    def _patch_compiled_functions(self) -> None:
        """``torch.compile(fn)`` of a function (not a module): dynamo inlines the model's call
        inside it, where no root call sees it (the model's forward went untimed, the step's end
        stayed pending through it, and a value logged after it went to the step before). Each
        such function's dynamo context (``OptimizeContext``, one per ``torch.compile`` call) gets
        a :class:`_CompiledCall` among its ``enter_exit_hooks``, which its compiled wrapper runs
        around every call, outside dynamo's tracing: nothing is traced, guarded or recompiled, and
        a loop that calls no compiled function runs nothing of it. A module's context
        (``torch.compile(model)``, ``model.compile()``) gets none: the root call times those.
        Contexts made before this patch (a function compiled before ``init``) are looked for by
        the next scan (:meth:`_hook_old_contexts`)."""
        if self._fn_patched:
            return
        mod = sys.modules.get(DYNAMO_MODULE)
        cls = getattr(mod, "OptimizeContext", None)
        if not isinstance(cls, type) or not callable(getattr(cls, "__call__", None)):
            return
        self._fn_patched = True
        self._contexts_due = True
        orig = cls.__call__
        import torch.nn as nn

        @functools.wraps(orig)
        def __call__(ctx: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            module = isinstance(fn, nn.Module)
            if module:  # its OptimizedModule compiles the module's __call__ with this context
                self._compiling_module += 1
            try:
                out = orig(ctx, fn, *args, **kwargs)
            finally:
                if module:
                    self._compiling_module -= 1
            try:
                if self.tracker.enabled and not module and not self._compiling_module and _compiles_a_function(fn):
                    self._hook_context(ctx, _function_name(fn) or "")
            except Exception as e:
                self._on_error("hooks.compile", e)
            return out

        self._patch(cls, "__call__", __call__)

    def _hook_context(self, ctx: Any, name: str | None) -> None:
        """Give a compiled function's dynamo context its enter hook (once)."""
        hooks = getattr(ctx, "enter_exit_hooks", None)
        if type(hooks) is not list or ctx in self._fn_contexts or getattr(ctx, "export", False) is True:
            return  # (torch.export's tracing call is no step's work)
        call = _CompiledCall(self, name)
        hooks.append(call)
        self._fn_contexts[ctx] = call

    def _hook_old_contexts(self, objects: list[Any], modules: list[Any]) -> None:
        """The scan's heap pass (the first one after the patch): the compiled functions' contexts
        made before it (``@torch.compile`` at import, ``stepwatch.init()`` in ``main()``). A
        module's context gets no hook: the one an ``OptimizedModule`` holds (``torch.compile(model)``),
        and the one of a module compiled in place (``model.compile()``: its compiled call's)."""
        cls = getattr(sys.modules.get(DYNAMO_MODULE), "OptimizeContext", None)
        if not isinstance(cls, type):
            return
        contexts, _ = _instances(objects, cls, _Never)
        if not contexts:
            return
        of_modules = set()
        for m in modules:
            d = getattr(m, "__dict__", _NO_DICT)
            if "dynamo_ctx" in d:
                of_modules.add(id(d["dynamo_ctx"]))
            impl = d.get("_compiled_call_impl")
            if isinstance(impl, _RootCallBase) and not impl.bound:
                impl = impl.inner
            if impl is not None:
                of_modules.add(id(_context_of(impl)))
        for ctx in contexts:
            if id(ctx) not in of_modules:
                self._hook_context(ctx, None)

    def _trained_in_eval(self) -> bool:
        """The roots an optimizer has stepped are all in eval mode (``model.eval()``): a compiled
        function called now evaluates the model (a compiled call cannot say which module it calls)."""
        if not self._seen_optimizers:
            return False
        key = (len(self.roots), len(self._seen_optimizers))
        cached = self._eval_roots
        if cached is None or cached[0] != key:  # new roots, or an optimizer's first step
            cached = self._eval_roots = (key, [weakref.ref(m) for m in list(self._hooked) if self._trained(m)])
        trained = False
        for ref in cached[1]:
            m = ref()
            if m is None:
                continue
            if getattr(m, "training", True) is not False:
                return False
            trained = True
        return trained

    def rootless_compiled(self, step: int) -> None:
        """Step ``step``'s forward ran in a compiled function that no root's forward came before:
        its FLOPs and samples are not counted, and a count of the modules called outside it (a
        loss module: 0 FLOPs) would read as the step's (MFU 0, a false low-MFU finding). Its
        record says so (``extras["compiled_forward"]``, read by the FLOP enricher), through a
        collector added at the first such call: a loop without compiled functions has none."""
        col = self._compiled_col
        if col is None:
            col = self._compiled_col = _CompiledForward(self.tracker)
            self.tracker.collectors.append(col)
        col.steps.add(step)

    def _compiled_unseen(self, name: str | None) -> None:
        """A compiled function's call was a step's forward, with no root's forward timed before it
        in the step: what it computes is not counted (said once). ``name``: the function's, "" when
        it has none, None for a context found by the scan."""
        from .._log import warn_once

        self._compiled_said = True
        warn_once(
            "compiled-function",
            "stepwatch: %s runs the step's forward: its time up to the first "
            "backward or optimizer step inside it is forward_s, but torch.compile inlines the module calls "
            "inside it, out of stepwatch's reach, so their FLOPs and samples are not counted: FLOPs, MFU and "
            "samples are null (or count only modules called outside it), and stepwatch.init(flops=...) is "
            "not applied to it either. To count them, compile the model instead of a function around it: "
            "torch.compile(model) or model.compile(), called in the function or the loop "
            "(docs/frameworks.md, 'Compiled functions').",
            f"the torch.compile'd function '{name}'" if name else
            "a torch.compile'd function" + (" (compiled before stepwatch started)" if name is None else ""),
        )

    def _unwrap_calls(self) -> None:
        for ref, call_ref, before in reversed(self._calls):
            _restore(ref(), call_ref(), before)
        self._calls.clear()

    def _unwrap_call(self, m: Any) -> None:
        """One root's calls put back (it stops being a root: torch.compile's wrapper took its place)."""
        keep = []
        for ref, call_ref, before in reversed(self._calls):
            if ref() is m:
                _restore(m, call_ref(), before)
            else:
                keep.append((ref, call_ref, before))
        self._calls[:] = reversed(keep)


def _restore(m: Any, call: Any, before: Any) -> None:
    """Put back what ``m._compiled_call_impl`` was before stepwatch's root call ``call`` (see
    ``Instrumentation._wrap_call``)."""
    if m is None or call is None or m.__dict__.get("_compiled_call_impl") is not call:
        return  # gone, or replaced since (a later compile(), another tool): left as is
    if before is _MISSING:
        del m.__dict__["_compiled_call_impl"]
    else:
        object.__setattr__(m, "_compiled_call_impl", call.inner if before is _INNER else before)


def _checkpoint_sequential(inst: "Instrumentation", orig: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.utils.checkpoint.checkpoint_sequential``, wrapped: given a hooked root (an
    ``nn.Sequential`` model checkpointed in segments), it calls the model's layers one by one and
    never the model, so no root call saw its forward (other_s, samples and FLOPs null). The call
    is the root's forward here, through a root call of its own (the observers see the model and
    its input, as for ``model(x)``); anything else passes as it is."""

    @functools.wraps(orig)
    def checkpoint_sequential(functions: Any, segments: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        call = getattr(functions, "__dict__", _NO_DICT).get("_compiled_call_impl")
        if not isinstance(call, _RootCallBase) or call.inst is not inst:
            return orig(functions, segments, input, *args, **kwargs)
        return _RootCall(inst, functions, lambda x: orig(functions, segments, x, *args, **kwargs))(input)

    return checkpoint_sequential


_NO_DICT: dict[str, Any] = {}


def _found_inf(scaler: Any, optimizer: Any) -> Any:
    """Did ``scaler.step(optimizer)`` skip the update of an optimizer that skips it itself (fused
    or capturable: ``_step_supports_amp_scaling``)? Its step ran either way, so the tracker saw no
    skip; the scaler's ``found_inf`` per device (kept until ``scaler.update()``) says. CPU tensors
    are read now (plain memory: the step is done, no device to wait for); CUDA ones are summed on
    a device and copied to host without blocking, read by the pipeline (``cuda_ext.Pending``).
    None: not known (a disabled scaler; another device, whose read would wait for it)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    found = state.get("found_inf_per_device") if isinstance(state, dict) else None
    if not found:
        return None  # a disabled scaler: nothing checked
    values = list(found.values())
    kinds = {t.device.type for t in values}
    if kinds == {"cpu"}:
        return any(bool(t.item()) for t in values)
    if kinds != {"cuda"}:
        return None
    from ..cuda_ext import Pending, copy_to_host

    total = values[0]
    for t in values[1:]:
        total = total + t.to(total.device, non_blocking=True)
    return Pending(*copy_to_host(total))


class _RootParams:
    """The optimizer a loop without one does not have, as the grad-norm probe reads one: its
    ``param_groups`` hold the parameters of the hooked roots whose gradient the last backward
    wrote (a new grad, or the same one changed: accumulated, or written after an in-place zero).
    Another model's grads left from before (an earlier model still alive, an EMA, a teacher) are
    not this update's and are left out."""

    __slots__ = ("param_groups", "_roots", "_params", "_marks", "__weakref__")

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": []}]
        self._roots = -1
        self._params: list[Any] = []
        # id(param) -> (weakref to its grad, the grad's _version) as last seen (an id could be a
        # new grad's at the old one's address)
        self._marks: dict[int, tuple[Any, int]] = {}

    def _candidates(self, inst: "Instrumentation") -> list[Any]:
        if len(inst.roots) != self._roots:
            seen: set[int] = set()
            params = []
            for m in list(inst._hooked):
                for p in m.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._params = params
            self._roots = len(inst.roots)
        return self._params

    def mark(self, inst: "Instrumentation") -> None:
        """Before the first backward: the grads as they are (another model's stay unchanged)."""
        self._marks = {id(p): (weakref.ref(g), g._version) for p in self._candidates(inst) if (g := p.grad) is not None}

    def refresh(self, inst: "Instrumentation") -> None:
        """After a backward: ``param_groups`` = the parameters whose grad it wrote."""
        marks = self._marks
        written = []
        for p in self._candidates(inst):
            g = p.grad
            if g is None:
                continue
            was = marks.get(id(p))
            if was is None or was[0]() is not g or was[1] != g._version:
                marks[id(p)] = (weakref.ref(g), g._version)
                written.append(p)
        self.param_groups = [{"params": written}]


def _no_call() -> None:
    """What a copied or unpickled ``_RootCall`` becomes: None (the copy's call is torch's own)."""
    return None


class _PyBackwardCore:
    """``torch.autograd.backward`` (what ``Tensor.backward`` calls), wrapped: the backward phase
    around torch's own. In Python: the reference that hooks/_ctracker.c's ``BackwardCall``
    translates, and the wrapper itself wherever that extension is missing."""

    __slots__ = ("inst", "tr", "inner", "replay")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replay = self.replay
        if replay.active and replay.mine():  # stepwatch's own FLOP-count replay (reentrant checkpoint)
            return self.inner(*args, **kwargs)
        inst = self.inst
        tr = self.tr
        if tr.enabled and not inst._boundary_checked:
            inst._check_boundary()
        tr.backward_begin()
        try:
            return self.inner(*args, **kwargs)
        except BaseException as e:
            if inst.exception_observers:
                inst._observe_exception("backward", e)
            raise
        finally:
            tr.backward_end()


class _BackwardBase:
    """What the wrapped backward holds; it passes for torch's function (``functools.wraps``)."""

    def __init__(self, inst: "Instrumentation", inner: Callable[..., Any]) -> None:
        from .replay import REPLAY

        self.inst = inst
        self.tr = inst.tracker
        self.inner = inner
        self.replay = REPLAY
        functools.update_wrapper(self, inner)


try:  # the same wrapper in C (hooks/_ctracker.c): less time a step, no frame of ours in a traceback
    from ._ctracker import BackwardCall as _BackwardCore
except ImportError:
    _BackwardCore = _PyBackwardCore


class _Backward(_BackwardBase, _BackwardCore):  # type: ignore[misc,valid-type]
    """``torch.autograd.backward`` wrapped: C where hooks/_ctracker.c was built, else :class:`_PyBackwardCore`."""


class _PyBackward(_BackwardBase, _PyBackwardCore):
    """The wrapped backward in Python whatever was built (tests run both)."""


class _Grad(_PyBackward):
    """``torch.autograd.grad`` wrapped: gradients taken without ``backward()`` (a manual update from
    ``autograd.grad``, WGAN-GP's gradient penalty) are backward time, and in a loop without a torch
    optimizer each call ends a step as a backward does. Inside a root forward (a physics-informed
    loss that takes input gradients in ``forward``) it is part of that forward: timed as backward
    too, it would be counted twice. In Python only: loops that use ``backward()`` never call it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.tr._fwd_depth:
            return self.inner(*args, **kwargs)
        return _PyBackwardCore.__call__(self, *args, **kwargs)


class _PyDataNextCore:
    """A DataLoader iterator's ``__next__`` (``_BaseDataLoaderIter``'s), wrapped: the data phase
    around torch's own; the first fetch of an enabled tracker scans for the roots. In Python: the
    reference that hooks/_ctracker.c's ``DataNext`` translates, and the wrapper itself wherever
    that extension is missing."""

    __slots__ = ("inst", "tr", "inner", "grad_enabled")

    def __call__(self, it: Any) -> Any:
        inst = self.inst
        tr = self.tr
        if _get_ident() != tr._thread:  # another thread's fetch (a prefetcher): not the loop's wait
            return self.inner(it)
        if not inst._data_scanned and tr.enabled:
            inst._data_scanned = True
            inst._scan("first data fetch")
        t0 = tr.data_begin()
        try:
            out = self.inner(it)
        except StopIteration:
            tr.data_end(t0, FETCH_END if self.grad_enabled() else FETCH_END | FETCH_NO_GRAD)
            raise
        except BaseException as e:
            if inst.exception_observers:
                inst._observe_exception("data", e)
            tr.data_end(t0, 0 if self.grad_enabled() else FETCH_NO_GRAD)
            raise
        tr.data_end(t0, 0 if self.grad_enabled() else FETCH_NO_GRAD)
        return out

    def __get__(self, it: Any, owner: Any = None) -> Any:
        return self if it is None else types.MethodType(self, it)


class _DataNextBase:
    """What the wrapped ``__next__`` holds; it passes for torch's (``functools.wraps``)."""

    def __init__(self, inst: "Instrumentation", inner: Callable[..., Any]) -> None:
        import torch

        self.inst = inst
        self.tr = inst.tracker
        self.inner = inner
        self.grad_enabled = torch.is_grad_enabled  # a fetch with grad disabled is evaluation
        functools.update_wrapper(self, inner)


def _timing_iter(tr: StepTracker, orig: Callable[..., Any]) -> Callable[..., Any]:
    """``DataLoader.__iter__`` (where a loader's workers start, or restart when persistent), with
    its start told to the tracker: an evaluation's span starts there (``iterator_made``)."""

    @functools.wraps(orig)
    def __iter__(loader: Any) -> Any:
        t0 = time.perf_counter_ns()
        it = orig(loader)
        tr.iterator_made(t0, time.perf_counter_ns())
        return it

    return __iter__


try:  # the same wrapper in C (hooks/_ctracker.c): no frame of ours a fetch, or in a traceback
    from ._ctracker import DataNext as _DataNextCore
except ImportError:
    _DataNextCore = _PyDataNextCore


class _DataNext(_DataNextBase, _DataNextCore):  # type: ignore[misc,valid-type]
    """The wrapped ``__next__``: C where hooks/_ctracker.c was built, else Python."""


class _PyDataNext(_DataNextBase, _PyDataNextCore):
    """The wrapped ``__next__`` in Python whatever was built (tests run both)."""


def _py_instances(objects: list[Any], a: type, b: type) -> tuple[list[Any], list[Any]]:
    """The objects whose type is a subclass of ``a``, and those of ``b``: the module discovery's pass
    over the heap. In Python: the reference that hooks/_ctracker.c's ``instances`` translates (3x
    faster: the pass is most of a session's start), and the pass wherever that is missing. type()
    rather than isinstance(): some objects warn when their ``__class__`` is read."""
    out_a: list[Any] = []
    out_b: list[Any] = []
    for o in objects:
        t = type(o)
        if issubclass(t, a):
            out_a.append(o)
        elif issubclass(t, b):
            out_b.append(o)
    return out_a, out_b


try:
    from ._ctracker import instances as _instances
except ImportError:
    _instances = _py_instances


def _communicates(frame: Any) -> bool:
    """A save called by torch.distributed itself, not by its checkpoint package: an object it
    serializes to send (``zero_redundancy_optimizer._broadcast_object``)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.startswith("torch.distributed.") and not name.startswith("torch.distributed.checkpoint")


class _TimedWait:
    """``result`` of an async checkpoint's future (``dcp.async_save``'s, or its
    ``AsyncSaveResponse``'s two): waiting on the training thread for a save still running is what
    the checkpoint costs the step (torchtitan waits before its next save and once at the end),
    ``checkpoint_s``; it was the step's ``other_s``, and the last one in no record. A finished
    save's result, or a wait on another thread, is only the result. The future weakly: it holds
    this in its ``__dict__``."""

    __slots__ = ("fut", "tr")

    def __init__(self, fut: Any, tr: StepTracker) -> None:
        self.fut = weakref.ref(fut)
        self.tr = tr

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fut = self.fut()
        result = type(fut).result
        tr = self.tr
        if fut.done() or _get_ident() != tr._thread:
            return result(fut, *args, **kwargs)
        t0 = tr.checkpoint_begin()
        try:
            return result(fut, *args, **kwargs)
        finally:
            tr.checkpoint_end(t0, None)  # what the save wrote is unknown, as for the save itself


def _time_waits(out: Any, tr: StepTracker) -> None:
    """Time the waits on what an async save returned (:class:`_TimedWait`); anything else as it is."""
    from concurrent.futures import Future

    for fut in (out, getattr(out, "staging_completion", None), getattr(out, "upload_completion", None)):
        if isinstance(fut, Future) and "result" not in fut.__dict__:
            fut.result = _TimedWait(fut, tr)


class _PyOptPreCore:
    """torch's global optimizer step pre-hook: the observers (the grad-norm probe), then the
    optimizer phase opens. In Python: the reference that hooks/_ctracker.c's ``OptPre``
    translates, and the hook itself wherever that extension is missing. A step given more than
    the optimizer (a closure, maybe) takes ``Instrumentation._opt_pre_args``."""

    __slots__ = ("inst", "tr")

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        tr = self.tr
        if not tr.enabled:
            return None
        inst = self.inst
        last = inst._last_optimizer  # the common case, one optimizer: no WeakSet lookup (~1 us)
        if last is None or last() is not optimizer:
            inst._new_optimizer(optimizer)
        if kwargs or len(args) > _CLOSURE_AT:
            return inst._opt_pre_args(optimizer, args, kwargs)
        if inst.optimizer_observers:
            inst._observe_optimizer(optimizer)
        tr.optimizer_begin()
        return None


class _OptPreBase:
    __slots__ = ()

    def __init__(self, inst: "Instrumentation") -> None:
        self.inst = inst
        self.tr = inst.tracker


try:  # the same hook in C (hooks/_ctracker.c): less time a step
    from ._ctracker import OptPre as _OptPreCore
except ImportError:
    _OptPreCore = _PyOptPreCore


class _OptPre(_OptPreBase, _OptPreCore):  # type: ignore[misc,valid-type]
    """The optimizer step pre-hook: C where hooks/_ctracker.c was built, else :class:`_PyOptPreCore`."""

    __slots__ = ()


class _PyOptPre(_OptPreBase, _PyOptPreCore):
    """The optimizer step pre-hook in Python whatever was built (tests run both)."""

    __slots__ = ()


class _PyRootCallCore:
    """A root module's call: observers, then the forward phase around the module's own call. In
    Python: the reference that hooks/_ctracker.c's ``RootCall`` translates, and the call itself
    wherever that extension is missing."""

    __slots__ = ("inst", "tr", "mod", "inner", "bound", "dynamo", "compiler", "replay", "grad_enabled", "follows")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # One frame: the user's traceback shows their frames and torch's, as without stepwatch
        # (this one is taken out before a bare ``raise``, which adds none back).
        try:
            mod = self.mod()
            if mod is None:
                raise ReferenceError("stepwatch: the root module of this call is gone")
            inner = functools.partial(self.inner, mod) if self.bound else self.inner
            if self.dynamo() or self.compiler._is_compiling_flag or (self.replay.active and self.replay.mine()):
                return inner(*args, **kwargs)
            inst = self.inst
            tr = self.tr
            # in_data: a module called inside a DataLoader fetch (a Dataset transform)
            if not tr.enabled or (inst._not_roots and id(mod) in inst._not_roots) or tr.in_data:
                return inner(*args, **kwargs)
            # Only the outermost call is observed: a declared root nested in another is part of it.
            # Inside a backward, a recompute (checkpoint(model, x)): the backward's work.
            if inst.forward_observers and not tr._fwd_depth:
                if tr._bwd_depth:
                    if inst.recompute_observers:
                        inst._observe_recompute(mod, args, kwargs)
                else:
                    if tr._pending_end is not None:
                        tr.work_begins()  # what the observers count belongs to the step this forward opens
                    inst._observe_forward(mod, args, kwargs)
            # A root in eval mode (model.eval()) is evaluation with grad enabled too: a validation
            # loop without torch.no_grad(). Training with the model in eval mode is still forward
            # time: the step's few calls before its backward are its own (_close_eval_for_work).
            # A root without parameters (a loss module, never put in eval mode; an augmentation,
            # often under torch.no_grad()) follows, grad or not: inside an open eval span it is
            # the span's, else the step's work. Per-sample augmentations under no_grad made more
            # grad-disabled calls than a step's own (IN_STEP_NO_GRAD_CALLS): an evaluation span
            # took the fetch and the augmentation out of the step.
            no_grad = False
            if self.follows:
                grad = not tr._eval_open
            else:
                no_grad = not self.grad_enabled()
                if no_grad and inst._ckpt_code is not None and called_from(inst._ckpt_code, sys._getframe(1)):
                    inst._checkpointed_forward(mod, args, kwargs)  # the step's forward, run without grad
                    no_grad = False
                grad = not no_grad and getattr(mod, "training", True) is not False
            tr.forward_begin(grad)
            if no_grad:
                inst._no_grad_call(mod)
            try:
                return inner(*args, **kwargs)
            except BaseException as e:
                if inst.exception_observers:
                    inst._observe_exception("forward" if grad else "eval", e)
                raise
            finally:
                tr.forward_end()
        except BaseException as e:
            _drop_own_frames(e)
            raise


class _CompiledCall:
    """The enter hook of a ``torch.compile``'d function's dynamo context
    (``Instrumentation._patch_compiled_functions``). The function's compiled wrapper calls it
    before each call, outside dynamo's tracing, and calls what it returns after the call, raised
    or not. A call made on the training thread at the top of the loop is the step's training work
    (``StepTracker.compiled_begin``); one inside a root's forward (a compiled attention function
    in the model), a backward, a fetch, the optimizer's own step, or stepwatch's FLOP replay is
    that work's, and passes untouched. A call with grad disabled, or while the trained model is in
    eval mode, is an evaluation call, as a root's would be. Never raises into the user's call."""

    __slots__ = ("inst", "name", "grad_enabled", "replay")

    def __init__(self, inst: Instrumentation, name: str | None) -> None:
        import torch

        from .replay import REPLAY

        self.inst = inst
        self.name = name
        self.grad_enabled = torch.is_grad_enabled
        self.replay = REPLAY

    def __call__(self) -> Callable[[], None]:
        inst = self.inst
        tr = inst.tracker
        if not tr.enabled or tr._fwd_depth or tr._bwd_depth or tr.in_data or _get_ident() != tr._thread:
            return _nothing
        try:
            if self.replay.active and self.replay.mine():
                return _nothing
            grad = self.grad_enabled()
            judged = False
            if inst._trained_in_eval():
                judged = not grad  # without grad, the trained model: evaluation (_no_grad_call)
                grad = False
            span = tr.compiled_begin(grad, judged)
        except Exception as e:
            inst._on_error("hooks.compiled_call", e)
            return _nothing
        if span is None:
            return _nothing
        return functools.partial(self._end, span)

    def _end(self, span: Any) -> None:
        inst = self.inst
        try:
            inst.tracker.compiled_end(span)
            if span.rootless and span.counted:
                inst.rootless_compiled(span.step)
                if not inst._compiled_said:
                    inst._compiled_unseen(self.name)
        except Exception as e:
            inst._on_error("hooks.compiled_call", e)


class _CompiledForward(Collector):
    """``extras["compiled_forward"]``: True on a step whose forward ran in a compiled function
    with no root's forward before it (``Instrumentation.rootless_compiled``), else None."""

    name = "compiled_forward"

    def __init__(self, tr: StepTracker) -> None:
        self.tr = tr
        self.steps: set[int] = set()

    def take(self) -> bool | None:
        steps = self.steps
        if not steps:
            return None
        step = self.tr.step
        out = True if step in steps else None
        steps.difference_update([s for s in steps if s <= step])
        return out


def _nothing() -> None:
    """What :class:`_CompiledCall` returns for a call that is not the tracker's: nothing after it."""
    return None


class _Never:
    """A type nothing is an instance of (``_instances`` takes two)."""


def _compiles_a_function(fn: Any) -> bool:
    """``torch.compile(fn)`` compiles a function or a method (``model.forward`` too), not a module:
    not a class, not a module's own call (``model.compile()`` compiles ``model._call_impl``;
    ``torch.compile(model)``'s wrapper, its ``__call__``, or a function wrapping the module)."""
    import torch.nn as nn

    if isinstance(fn, (type, nn.Module)) or isinstance(getattr(fn, "__wrapped__", None), nn.Module):
        return False
    owner = getattr(fn, "__self__", None)
    return not (isinstance(owner, nn.Module) and getattr(fn, "__name__", None) in _MODULE_CALLS)


_MODULE_CALLS = ("__call__", "_call_impl", "_wrapped_call_impl")


def _context_of(wrapper: Any) -> Any:
    """The dynamo context a compiled callable (torch's ``compile_wrapper``) calls through (its
    closure's ``self``), or None."""
    code = getattr(wrapper, "__code__", None)
    cells = getattr(wrapper, "__closure__", None)
    if code is None or not cells or "self" not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index("self")].cell_contents
    except (IndexError, ValueError):  # an empty cell
        return None


def _function_name(fn: Any) -> str | None:
    """A compiled function's name for the log: ``Trainer.train_step``; ``fwd`` for a function
    defined inside another (not ``main.<locals>.fwd``)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name.rpartition("<locals>.")[2] if isinstance(name, str) else None


# Frames above a root's own call (``Module._wrapped_call_impl`` first) searched for a reentrant
# checkpoint's forward: a lambda or a function of the user's between them is found too.
CHECKPOINT_CALLER_DEPTH = 4


def called_from(code: Any, frame: Any, depth: int = CHECKPOINT_CALLER_DEPTH) -> bool:
    """``code`` runs in ``frame`` or in one of the ``depth`` frames above it."""
    for _ in range(depth + 1):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


try:  # the same call in C (hooks/_ctracker.c): no frame of ours in a traceback, less time a call
    from ._ctracker import RootCall as _RootCallCore
except ImportError:
    _RootCallCore = _PyRootCallCore


class _RootCallBase:
    """What a root's call holds, and how it pickles, over either core. Pickled or deep-copied (a
    module whose own ``__getstate__`` keeps its ``__dict__``), it becomes None: a copy is never a
    second tracker of the original model."""

    __slots__ = ()

    def __init__(self, inst: "Instrumentation", mod: Any, inner: Callable[..., Any]) -> None:
        import torch

        from .replay import REPLAY

        self.inst = inst
        self.tr = inst.tracker
        # The module weakly, and its own call unbound: the module holds this call (its
        # ``_compiled_call_impl``), so a strong reference back (``mod``, or ``m._call_impl``, a
        # bound method) made a cycle, and a model the script dropped (a sweep's trial, a fold)
        # stayed in memory until a full cyclic collection: 6 trials held 6 models' memory.
        self.mod = weakref.ref(mod)
        func = getattr(inner, "__func__", None)
        if func is not None and getattr(inner, "__self__", None) is mod and func is getattr(type(mod), "_call_impl", None):
            self.inner, self.bound = func, True
        else:  # a compiled callable (model.compile()), which holds the module itself; a transient call
            self.inner, self.bound = inner, False
        # torch.compiler.is_compiling() without its two Python calls: dynamo constant-folds
        # is_dynamo_compiling() to True while it traces; the flag is torch.export's (non-strict).
        # A torch without either keeps is_compiling() itself.
        c = torch.compiler
        fast = hasattr(c, "is_dynamo_compiling") and type(getattr(c, "_is_compiling_flag", None)) is bool
        self.dynamo = c.is_dynamo_compiling if fast else c.is_compiling
        self.compiler = c if fast else _NO_FLAG
        self.replay = REPLAY
        self.grad_enabled = torch.is_grad_enabled
        try:  # a loss module: no parameter when it is hooked (see _PyRootCallCore)
            self.follows = next(iter(mod.parameters()), None) is None
        except Exception:  # noqa: BLE001 - a module whose parameters() fails is taken as a model
            self.follows = False

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_no_call, ())


class _RootCall(_RootCallBase, _RootCallCore):  # type: ignore[misc,valid-type]
    """A root's call: C where hooks/_ctracker.c was built, else :class:`_PyRootCallCore`."""

    __slots__ = ("__weakref__",)

    def __init__(self, inst: "Instrumentation", mod: Any, inner: Callable[..., Any]) -> None:
        super().__init__(inst, mod, inner)
        if _RootCallCore is not _PyRootCallCore and _constant_false(self.dynamo):
            # Dynamo reads bytecode and never runs C code while it traces: the C call runs
            # outside tracing only, where torch's is_dynamo_compiling() is ``return False``. Not
            # called (None), it costs no Python frame at each root call.
            self.dynamo = None


def _constant_false(fn: Any) -> bool:
    """``fn()`` returns False whenever it is called: a function of no parameters whose code reads
    no name (no global, builtin, attribute or closure cell) and that returned False once."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount or code.co_kwonlyargcount or code.co_names or code.co_freevars:
        return False
    try:
        return fn() is False
    except Exception:
        return False


class _PyRootCall(_RootCallBase, _PyRootCallCore):
    """A root's call in Python whatever was built (tests run both)."""

    __slots__ = ("__weakref__",)


class _NoFlag:
    _is_compiling_flag = False


_NO_FLAG = _NoFlag()


def _drop_own_frames(e: BaseException) -> None:
    """Take ``_RootCall``'s frames off the head of ``e``'s traceback, unless the exception began
    in one of them (then they are where it happened, and stay)."""
    own = _PyRootCallCore.__call__.__code__
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code is own and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not e.__traceback__:
        e.__traceback__ = tb


class _Inert:
    """What a stepwatch forward hook (before root calls were wrapped instead) became in a copy
    that kept it: does nothing, returns None. Kept so that such pickles still load."""

    def __call__(self, *args: Any) -> None:
        return None


def _without_root_hooks(state: Any) -> Any:
    """``nn.Module.__getstate__``'s state (a copy of ``__dict__``) with stepwatch's root call
    left out (torch's own ``__getstate__`` drops ``_compiled_call_impl`` too; this stays true
    whatever torch does), the module itself untouched."""
    if isinstance(state, dict) and isinstance(state.get("_compiled_call_impl"), _RootCallBase):
        del state["_compiled_call_impl"]
    return state


# ``frame_values(frame)``: a function frame's local values read without ``frame.f_locals``, or None
# where only f_locals can tell (hooks/_ctracker.c says why). Read through f_locals, Python 3.12's
# snapshot kept each caller's locals of the scan's time alive: a sweep's dropped model lived on
# until the next scan, or to the end of the function (3.12 reports its own objects as frozen, so
# every scan walked there). Before 3.12, and without the C module on 3.12, it still does, for a
# heap the script froze; 3.13's f_locals is a view, with no snapshot.
try:
    from ._ctracker import frame_values as _frame_values
except ImportError:
    def _frame_values(frame: Any) -> list[Any] | None:
        return None


# The walk of :func:`_reachable`: how many references deep from a frame's locals, and how many
# objects at most (the benchmark loop's frozen heap: ~20 ms a scan here, kept out of the step).
WALK_DEPTH = 6
WALK_MAX = 200_000


def _reachable(frame: Any, kinds: tuple[type, ...]) -> list[Any]:
    """The objects of ``kinds`` reachable from the locals of ``frame`` and its callers, and from
    ``__main__``, at most :data:`WALK_DEPTH` references deep: a training loop's model and optimizer
    are its locals, or attributes of one (a trainer). For a heap that ``gc.freeze()`` froze: the
    objects it froze are not in ``gc.get_objects()``, and no API lists them without unfreezing
    them (which would change what the job keeps). The walk stops at an object of ``kinds`` (a
    module's children are read from the module, by the scan) and does not enter types, Python
    modules, strings or tensors."""
    import types

    import torch

    opaque = (type, types.ModuleType, types.FrameType, str, bytes, int, float, torch.Tensor)
    frontier: list[Any] = []
    while frame is not None:
        values = _frame_values(frame)
        # f_locals's values: from 3.13 on a function frame's is a view, whose referents (what
        # the walk reads of an object) are the frame alone, not the locals
        frontier += list(frame.f_locals.values()) if values is None else values
        frame = frame.f_back
    main = sys.modules.get("__main__")
    if main is not None:
        frontier.append(vars(main))
    seen: set[int] = set()
    found: list[Any] = []
    for _ in range(WALK_DEPTH + 1):
        nxt: list[Any] = []
        for o in frontier:
            if id(o) in seen:
                continue
            seen.add(id(o))
            t = type(o)
            if issubclass(t, kinds):
                found.append(o)
            elif not issubclass(t, opaque) and len(seen) < WALK_MAX:
                nxt.extend(gc.get_referents(o))
        frontier = nxt
    return found


def _marking_workers(orig_init: Callable[..., Any]) -> Callable[..., Any]:
    """The multi-process DataLoader iterator's ``__init__`` (where it starts its workers), with
    ``STEPWATCH_DATALOADER_WORKER`` set to this pid meanwhile: a worker started with 'spawn'
    imports the script again, and its ``import stepwatch.auto`` must start no session there."""
    from .._env import DATALOADER_WORKER

    @functools.wraps(orig_init)
    def __init__(it: Any, *args: Any, **kwargs: Any) -> None:
        before = os.environ.get(DATALOADER_WORKER)
        os.environ[DATALOADER_WORKER] = str(os.getpid())
        try:
            orig_init(it, *args, **kwargs)
        finally:
            if before is None:
                os.environ.pop(DATALOADER_WORKER, None)
            else:
                os.environ[DATALOADER_WORKER] = before

    return __init__


class _UnseenForward(Collector):
    """Training thread, for the first steps only. A step that ran backward while no root forward
    was timed (past the run's first step, whose forward may come before its model is found)
    hooks the direct submodules of the roots as roots at its end (``declare_roots``): the
    model's methods call those. The next such step goes a level further down, up to
    ``DESCEND_LEVELS``. The first step whose forward was timed ends the watch, as does a level
    with no submodule or more than ``DESCEND_MAX``: the log line of ``UnseenForwardCheck`` then
    says what is left (plain tensor code). A call nested in another root's is observed once, as
    part of it, so a root that is also called gets nothing twice.

    A step's end is final at the next step's first work: with no DataLoader that is its
    backward, after its forward, so the step in which a level was hooked tells nothing of it
    and is not judged (judged, it took a level more: hooks on every layer, for nothing)."""

    name = "unseen_forward"  # its extras entry, always None: read by no one

    def __init__(self, inst: Instrumentation) -> None:
        self.inst = inst
        self.state: str | None = None  # the step's: "forward" (timed), "unseen" (backward only), None
        self.first = True
        self.levels = 0
        self.frontier: list[Any] | None = None  # weak references to the last level hooked
        self.hooked_in = -1  # the step that was open when the last level was hooked

    def take(self) -> None:
        tr = self.inst.tracker
        # A compiled function's call (StepTracker.compiled_begin) is forward time, but no root's:
        # a model called through its methods beside it is still looked for.
        fwd = tr._fwd - tr.compiled_forward_ns() if tr._fwd else 0
        self.state = "forward" if fwd else "unseen" if tr._bwd else None
        return None

    def step_ended(self, step: int) -> None:
        state, self.state = self.state, None
        if state is None:
            return
        first, self.first = self.first, False
        if state == "forward":
            self._stop()
        elif not first and step != self.hooked_in:
            self._descend(step + 1)

    def _descend(self, open_step: int) -> None:
        inst = self.inst
        if self.frontier is None:
            level = list(inst._hooked)
        else:
            level = [m for ref in self.frontier if (m := ref()) is not None]
        below = []
        for m in level:
            for c in _children(m):
                # a submodule with no parameters (an activation, a dropout) is never the model:
                # timed, its FLOPs (0.0) and samples stood for the step's (mnist_forward_forward)
                if (c is not None and c not in inst._hooked and id(c) not in inst._not_roots
                        and not is_replay_module(c) and _holds_parameters(c)):
                    below.append(c)
        self.levels += 1
        if not below or len(below) > DESCEND_MAX or self.levels > DESCEND_LEVELS:
            self._stop()
            return
        self.frontier = [weakref.ref(c) for c in below]
        self.hooked_in = open_step
        inst.declare_roots(model=below)

    def _stop(self) -> None:
        tr = self.inst.tracker
        tr.collectors = [c for c in tr.collectors if c is not self]
        tr.remove_listener(self.step_ended)


def _holds_parameters(m: Any) -> bool:
    """``m`` or a module below it has a parameter."""
    try:
        return next(iter(m.parameters()), None) is not None
    except Exception:  # not a module as torch's (no parameters()): as before, a candidate
        return True


def _children(m: Any) -> Any:
    """``m``'s direct submodules as discovery sees them (None among them is skipped by the
    caller): its ``_modules``, or a traced module's script module (``_actual_script_module``,
    which holds the parameters and submodules); none for a module whose ``__init__`` never ran."""
    d = getattr(m, "__dict__", _NO_DICT)
    if "_modules" in d:
        return d["_modules"].values()
    return (d.get("_actual_script_module"),)


def _has_children_dict(m: Any) -> bool:
    """``m``'s ``__init__`` ran (a deepcopy or an unpickling that failed half way left no
    ``_modules``), or it is a traced module, whose children are its script module's."""
    d = getattr(m, "__dict__", ())
    return "_modules" in d or "_actual_script_module" in d


def _steps_a_root(optimizers: list[Any], roots: list[Any]) -> bool:
    """Does one of ``optimizers`` hold a parameter of the hooked roots? (An optimizer of another
    model, or one that is garbage not yet collected, says nothing about this loop.)"""
    if not optimizers:
        return False
    params = {id(p) for m in roots for p in m.parameters()}
    for m in roots:
        params.update(_sharded_param_ids(m))
    return any(id(p) in params for o in optimizers for g in o.param_groups for p in g["params"])


def _sharded_param_ids(root: Any) -> set[int]:
    """The ids of the sharded parameters FSDP2 (``fully_shard``) keeps for ``root``'s modules: the
    ones an optimizer holds. Between a forward and its backward a module sharded with
    ``reshard_after_forward=False`` registers its unsharded parameters instead, and the first
    backward found no optimizer of the model (each backward then ended a step). Empty without
    FSDP2, or where its internals differ from torch 2.4-2.13's."""
    ids: set[int] = set()
    for m in root.modules():
        if getattr(type(m), "_get_fsdp_state", None) is None:
            continue
        try:
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else ():
                ids.add(id(fp.sharded_param))
        except Exception:  # noqa: BLE001 - another torch's FSDP2: the registered parameters alone
            pass
    return ids


# A step pre-hook gets ``args`` of ``step`` as called through the optimizer's hook wrapper: the
# optimizer itself first (torch/optim/optimizer.py, ``profile_hook_step``), then the closure.
_CLOSURE_AT = 1


def _closure_arg(args: Any, kwargs: Any) -> Any:
    """The closure passed to ``optimizer.step(closure)``, or None."""
    c = kwargs.get("closure") if kwargs else None
    if c is None and len(args) > _CLOSURE_AT:
        c = args[_CLOSURE_AT]
    return c if callable(c) else None


def _with_closure(args: Any, kwargs: Any, closure: Any) -> tuple[Any, Any]:
    """(args, kwargs) for the optimizer with its closure replaced (a step pre-hook may return them)."""
    if kwargs and kwargs.get("closure") is not None:
        return tuple(args), {**kwargs, "closure": closure}
    a = tuple(args)
    return (*a[:_CLOSURE_AT], closure, *a[_CLOSURE_AT + 1 :]), dict(kwargs or {})


def _position(f: Any) -> int | None:
    if f is None or isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        return None
    try:
        return f.tell()
    except Exception:  # not seekable: bytes unknown
        return None


def _written(f: Any, start: int | None) -> int | None:
    if f is None:
        return None
    try:
        if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
            return os.stat(f).st_size
        if start is not None:
            return f.tell() - start
    except Exception:  # a file that vanished or cannot tell: bytes unknown
        return None
    return None


class _Missing:
    pass


_MISSING = _Missing()
_INNER = _Missing()  # _unwrap_calls: put back the call's inner (what was there before it)

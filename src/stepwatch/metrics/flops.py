"""FLOPs of one micro-batch (forward + backward), counted on fake tensors, once per input shape.

How it counts: the outermost module's forward is replayed under ``FakeTensorMode`` (no memory, no
kernels) inside ``FlopCounterMode``, on fake copies of the parameters, buffers and inputs, then
autograd runs backward from ``ones_like`` of the outputs (backward FLOPs do not depend on the
seed's values). Nothing real is read or written: not the parameters, buffers, ``.grad``, nor the
RNG state (saved and restored; a test checks all four): the default generators, and those the
model's modules hold as attributes (``_held_rng_states``).

When the forward cannot run on fakes (an ``.item()``, ``int(tensor)``), the call is counted once
on real tensors instead (``count_step_flops(real=True)``): a real forward and backward, on clones
of the buffers and inputs and on detached *aliases* of the parameters, which share the real
storage. Training first: a guard (a dispatch mode, ``_make_write_guard``) stops any op that would
write into the storage of a real parameter or buffer *before* it runs, whatever tensor it goes
through (the alias, ``.data``, a view, a reference kept in a list), so a forward that writes its
own parameters (MoCo's momentum key encoder, a running statistic in a frozen ``nn.Parameter``, a
clamp under ``no_grad``) never changes the model. Such a replay is abandoned and run again on
copies of all the parameters, only if they fit in half the free memory of their device (the
driver's free memory plus torch's cached, unused blocks; ``MemAvailable`` on CPU); else, or when
the write goes through a reference no copy replaces, the FLOPs are null with one line that says
why (``FlopCountRefused``). So memory is spent only for a forward that writes its parameters,
once per input signature, never on the hot path; a version counter could not do this (it sees a
write only after it landed, and misses ``.data``), nor could counting inside the user's own
forward (a dispatch mode over the user's step, backward included, on the hot path).

What counts as model FLOPs (MFU), following PaLM (Chowdhery et al. 2022, appendix B):
- matmul / conv / attention as FlopCounterMode's formulas (2*m*n*k per matmul);
- backward = what autograd runs: grad-input only where the input needs grad, grad-weight for
  parameters that require grad;
- activation recompute (``torch.utils.checkpoint``, reentrant or not) is NOT model FLOPs: ops
  that run with grad enabled *during* backward are recompute and go to ``FlopCount.recompute``
  (autograd runs real backward ops with grad disabled unless create_graph);
- attention counts the full score matrix, causal or not (as FlopCounterMode and torchtitan);
  its backward counts 4 matmuls (dQ, dK, dV, dP): the 5th that fused kernels run to rebuild the
  scores is kernel-internal recompute and goes to ``recompute`` too, so HFU includes it.
``hfu`` FLOPs = model FLOPs + recompute.

SDPA on CPU: FlopCounterMode has no formula for ``_scaled_dot_product_flash_attention_for_cpu``
(it counts 0); we register one (same shapes as the CUDA kernels, GQA included). Flex attention is
counted by torch's own formula for the ``flex_attention`` higher-order op (full score matrix; a
block mask's sparsity is ignored unless a ``sparsity_hint`` is attached).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from .._log import warn_once
from ..hooks.replay import is_counting, replay_module, set_counting
from .peaks import matmul_dtype_key

log = logging.getLogger(__name__)

class FlopCountError(RuntimeError):
    """The FLOPs of this call could not be counted (e.g. data-dependent Python control flow)."""


class FlopCountNotReady(FlopCountError):
    """Not countable yet (lazy modules before their first real forward); try again later."""


def _add(a: Mapping[str, int], b: Mapping[str, int], k: int = 1) -> dict[str, int]:
    out = dict(a)
    for key, v in b.items():
        out[key] = out.get(key, 0) + v * k
    return out


@dataclass(frozen=True, slots=True)
class FlopCount:
    """FLOPs of one micro-batch by dtype key (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``...).

    ``forward`` + ``backward`` are the model FLOPs (MFU); ``recompute`` is what activation
    checkpointing and fused-attention kernels compute again (HFU adds it). ``alignment`` lists
    matmuls whose dims are not Tensor Core friendly (see ``count_step_flops(lint_devices=...)``).
    Treat the dicts as read-only.

    ``tf32_sensitive``: the split between ``fp32`` and ``tf32`` may follow torch's TF32 switches
    (the count holds an fp32 matmul or convolution on a CUDA device). The last-call fast paths
    read those switches at a call only when it is True. A count from ``count_step_flops`` knows;
    any other (a user's counter, an override) is taken as sensitive.
    """

    forward: Mapping[str, int] = field(default_factory=dict)
    backward: Mapping[str, int] = field(default_factory=dict)
    recompute: Mapping[str, int] = field(default_factory=dict)
    alignment: tuple[dict[str, Any], ...] = ()
    tf32_sensitive: bool = field(default=True, compare=False, repr=False)

    @property
    def empty(self) -> bool:
        """No FLOPs at all (a loss module's count, most often)."""
        return not (self.forward or self.backward or self.recompute)

    @property
    def by_dtype(self) -> dict[str, int]:
        return _add(self.forward, self.backward)

    @property
    def total(self) -> int:
        return sum(self.forward.values()) + sum(self.backward.values())

    @property
    def hfu_by_dtype(self) -> dict[str, int]:
        return _add(self.by_dtype, self.recompute)

    @property
    def hfu_total(self) -> int:
        return self.total + sum(self.recompute.values())

    def __add__(self, other: "FlopCount") -> "FlopCount":
        if not isinstance(other, FlopCount):
            return NotImplemented
        return FlopCount(
            _add(self.forward, other.forward),
            _add(self.backward, other.backward),
            _add(self.recompute, other.recompute),
            self.alignment,
            self.tf32_sensitive or other.tf32_sensitive,
        )

    def scaled(self, k: int) -> "FlopCount":
        """k identical micro-batches (gradient accumulation with a fixed shape)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        return FlopCount(_add({}, self.forward, k), _add({}, self.backward, k), _add({}, self.recompute, k), self.alignment,
                         self.tf32_sensitive)

    @classmethod
    def from_total(cls, flops: float, dtype_key: str) -> "FlopCount":
        """A user-given total (forward + backward) attributed to one dtype key."""
        return cls(forward={dtype_key: int(flops)})


def sum_counts(counts: "Iterator[FlopCount] | list[FlopCount]") -> FlopCount | None:
    """FLOPs of a step from its micro-batches; None if any micro-batch is unknown."""
    total = FlopCount()
    n = 0
    for c in counts:
        if c is None:
            return None
        total = total + c
        n += 1
    return total if n else None


# ----------------------------------------------------------------------------- formulas


def _bmm(b: int, m: int, k: int, n: int) -> int:
    return 2 * b * m * k * n


def _sdpa_fwd(q: Any, k: Any, v: Any) -> int:
    # Full score matrix (no causal discount). GQA: the kernel broadcasts the kv heads, so the
    # work is that of h_q heads.
    b, hq, sq, dq = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    return _bmm(b * hq, sq, dq, sk) + _bmm(b * hq, sq, sk, dv)


def _sdpa_bwd_split(q: Any, k: Any, v: Any) -> tuple[int, int]:
    """(model FLOPs, kernel recompute FLOPs) of an attention backward."""
    b, hq, sq, dq = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    model = (
        _bmm(b * hq, sq, dv, sk)  # dP = dO @ V^T
        + _bmm(b * hq, sk, sq, dv)  # dV = P^T @ dO
        + _bmm(b * hq, sq, sk, dq)  # dQ = dS @ K
        + _bmm(b * hq, sk, sq, dq)  # dK = dS^T @ Q
    )
    return model, _bmm(b * hq, sq, dq, sk)  # S = Q @ K^T rebuilt inside the kernel


def _cpu_sdpa_fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
    return _sdpa_fwd(query, key, value)


def _cpu_sdpa_bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    model, recompute = _sdpa_bwd_split(query, key, value)
    return model + recompute


_cpu_sdpa_fwd._get_raw = True  # type: ignore[attr-defined]
_cpu_sdpa_bwd._get_raw = True  # type: ignore[attr-defined]


# RNNs (LSTM, GRU, RNN): FlopCounterMode has no formula for the fused kernels (CPU's
# ``mkldnn_rnn_layer``, cuDNN's ``_cudnn_rnn``, ROCm's ``miopen_rnn``), so an LSTM counted 0.
# Every timestep multiplies the input by W_ih and the hidden state by W_hh (and, with
# ``proj_size``, by W_hr): forward = 2 * (timesteps * batch) * (sum of the 2-D weights' numel),
# gate non-linearities not counted (matmul FLOPs, as everywhere here). The backward kernels
# compute grad-input and grad-weight for every matmul: 2x forward.
def _rnn_tokens(inp: Any) -> int:
    return int(inp.numel() // inp.shape[-1]) if inp.dim() else 0


def _rnn_fwd(inp: Any, weights: Any) -> int:
    return 2 * _rnn_tokens(inp) * sum(int(w.numel()) for w in weights if w is not None and w.dim() == 2)


def _mkldnn_rnn_fwd(input, weight0, weight1, *args, out_val=None, **kwargs) -> int:
    return _rnn_fwd(input, (weight0, weight1))


def _mkldnn_rnn_bwd(input, weight1, weight2, *args, out_val=None, **kwargs) -> int:
    return 2 * _rnn_fwd(input, (weight1, weight2))


def _cudnn_rnn_fwd(input, weight, *args, out_val=None, **kwargs) -> int:
    return _rnn_fwd(input, weight)


def _cudnn_rnn_bwd(input, weight, *args, out_val=None, **kwargs) -> int:
    return 2 * _rnn_fwd(input, weight)


for _f in (_mkldnn_rnn_fwd, _mkldnn_rnn_bwd, _cudnn_rnn_fwd, _cudnn_rnn_bwd):
    _f._get_raw = True  # type: ignore[attr-defined]


def _attention_ops() -> tuple[dict[Any, Callable[..., Any]], dict[Any, tuple[int, int]]]:
    """Extra formulas, and for each attention backward op the positions of (query, value)."""
    import torch

    aten = torch.ops.aten
    extra: dict[Any, Callable[..., Any]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_fwd
        extra[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_bwd
    if hasattr(aten, "_scaled_dot_product_fused_attention_overrideable"):
        extra[aten._scaled_dot_product_fused_attention_overrideable] = _cpu_sdpa_fwd
        extra[aten._scaled_dot_product_fused_attention_overrideable_backward] = _cpu_sdpa_bwd
    for name, formula in (
        ("mkldnn_rnn_layer", _mkldnn_rnn_fwd),
        ("mkldnn_rnn_layer_backward", _mkldnn_rnn_bwd),
        ("_cudnn_rnn", _cudnn_rnn_fwd),
        ("_cudnn_rnn_backward", _cudnn_rnn_bwd),
        ("miopen_rnn", _cudnn_rnn_fwd),
        ("miopen_rnn_backward", _cudnn_rnn_bwd),
    ):
        if hasattr(aten, name):
            extra[getattr(aten, name)] = formula
    bwd_qv: dict[Any, tuple[int, int]] = {}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_fused_attention_overrideable_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
    ):
        if hasattr(aten, name):
            bwd_qv[getattr(aten, name)] = (1, 3)
    try:
        from torch._higher_order_ops.flex_attention import flex_attention_backward

        bwd_qv[flex_attention_backward] = (0, 2)
    except ImportError:  # pragma: no cover - older torch
        pass
    return extra, bwd_qv


_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
_CONVS = ("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable", "_slow_conv2d_forward", "convolution_backward")


def _first_tensor(args: Any) -> Any:
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _sparse_matmul_flops(packet: Any, args: Any) -> int | None:
    """A matrix product with a sparse operand (``torch.spmm(adjacency, x)``: a graph network's) as
    the work it does, 2 x its stored elements x the dense operand's other side; None for any
    other op. torch's formula takes every operand as dense: a 0.1%-dense adjacency counted ~1000
    times its work (pytorch/examples' gcn)."""
    import torch

    name = getattr(packet, "__name__", "")
    if name not in ("mm", "addmm"):
        return None
    a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    a_sparse, b_sparse = a.layout != torch.strided, b.layout != torch.strided
    if a_sparse == b_sparse:  # both dense (torch's formula), or both sparse (rare: torch's too)
        return None
    sparse, other = (a, b.shape[-1]) if a_sparse else (b, a.shape[-2])
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(sparse, FakeTensor):
        # a fake sparse tensor holds no elements (nnz 0): counted once on real tensors instead
        raise FlopCountError("a sparse operand's stored elements are not known on fake tensors")
    try:
        return 2 * int(sparse._nnz()) * int(other)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):  # no count of its elements: torch's
        return None


def _make_counter(lint_devices: tuple[str, ...]) -> Any:
    """A FlopCounterMode that splits FLOPs by phase (forward / backward / recompute) and dtype."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    extra, bwd_qv = _attention_ops()
    allow_tf32_mm = bool(torch.backends.cuda.matmul.allow_tf32)
    allow_tf32_conv = bool(torch.backends.cudnn.allow_tf32)

    class _Counter(FlopCounterMode):
        def __init__(self) -> None:
            super().__init__(display=False, custom_mapping=extra)
            self.phase = "forward"
            self.buckets: dict[str, dict[str, int]] = {"forward": {}, "backward": {}, "recompute": {}}
            self.alignment: list[dict[str, Any]] = []
            self.tf32_sensitive = False  # an fp32 op on CUDA was counted (its key follows the switches)

        def _key(self, packet: Any, args: Any) -> str:
            t = _first_tensor(args if packet is not torch.ops.aten.addmm else args[1:])
            if t is None:
                return "fp32"
            name = getattr(packet, "__name__", str(packet))
            cuda = t.device.type == "cuda"
            tf32 = cuda and (allow_tf32_conv if name in _CONVS else allow_tf32_mm)
            if cuda and t.dtype == torch.float32:
                self.tf32_sensitive = True
            try:
                return matmul_dtype_key(t.dtype, None, tf32)
            except ValueError:
                return str(t.dtype).replace("torch.", "")

        def _lint(self, packet: Any, args: Any, key: str) -> None:
            name = getattr(packet, "__name__", str(packet))
            if name not in _MATMULS and name not in ("convolution", "_convolution"):
                return
            t = _first_tensor(args)
            if t is None or t.device.type not in lint_devices or len(self.alignment) >= 50:
                return
            if name in ("convolution", "_convolution"):
                dims = (args[1].shape[0], args[1].shape[1])  # C_out, C_in / groups
            else:
                a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
                dims = (a.shape[-2], a.shape[-1], b.shape[-1])
            need = {"bf16": 8, "fp16": 8, "fp8": 16, "int8": 16}.get(key)
            problem = None
            if need and any(int(d) % need for d in dims):
                problem = f"dims {tuple(int(d) for d in dims)} not all multiples of {need} for {key}"
            elif key == "fp32" and t.device.type == "cuda":
                problem = "fp32 matmul without TF32 (torch.backends.cuda.matmul.allow_tf32 is False)"
            if problem:
                parents = [p for p in self.mod_tracker.parents if p != "Global"]
                where = max(parents, key=len) if parents else "<top level>"
                entry = {"module": where, "op": name, "dtype": key, "problem": problem}
                if entry not in self.alignment:
                    self.alignment.append(entry)

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            formula = self.flop_registry.get(func_packet)
            if formula is None:
                return out
            n = _sparse_matmul_flops(func_packet, args)
            if n is None:
                n = int(formula(*args, **kwargs, out_val=out))
            if not n:
                return out
            key = self._key(func_packet, args)
            bucket = self.phase
            if bucket == "backward" and torch.is_grad_enabled():
                # Autograd runs backward ops with grad disabled (no create_graph); forward ops that
                # run with grad enabled during backward are checkpoint recompute.
                bucket = "recompute"
            if bucket == "forward":
                self._lint(func_packet, args, key)
            qv = bwd_qv.get(func_packet)
            if qv is not None and bucket == "backward":
                dq, dv = args[qv[0]].shape[-1], args[qv[1]].shape[-1]
                rec = n * dq // (3 * dq + 2 * dv)
                r = self.buckets["recompute"]
                r[key] = r.get(key, 0) + rec
                n -= rec
            b = self.buckets[bucket]
            b[key] = b.get(key, 0) + n
            return out

    return _Counter()


# ----------------------------------------------------------------------------- replay


def unwrap_module(module: Any) -> Any:
    """The module whose forward does the math: through DDP/DataParallel ``.module`` and
    ``torch.compile``'s ``OptimizedModule._orig_mod`` (counted eagerly)."""
    import torch

    seen = 0
    while seen < 8:
        seen += 1
        if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            module = module._orig_mod
            continue
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
            continue
        break
    return module


def _redirects_forward(module: Any) -> bool:
    """A framework wrapper whose forward is a whole training step, not a model call."""
    return any(c.__name__ == "_LightningModuleWrapperBase" for c in type(module).__mro__)


def _is_fsdp1(m: Any) -> bool:
    t = type(m)
    return t.__name__ == "FullyShardedDataParallel" and t.__module__.startswith("torch.distributed.fsdp")


def _never_replay(root: Any) -> str | None:
    """Why ``root`` must not be replayed at all (on fakes or real tensors), or None."""
    if _redirects_forward(root):
        # Lightning's strategy wrapper runs training_step (self.log stores tensors in the trainer's
        # state): replaying it on fake tensors would leak fakes into the job.
        return (
            f"{type(root).__name__} runs Lightning's training_step, not a model forward: FLOPs are "
            "not counted here; add stepwatch.integrations.lightning.StepwatchCallback() to the "
            "Trainer's callbacks so stepwatch times and counts the model's own modules"
        )
    if any(_is_fsdp1(m) for m in root.modules()):
        # Its first forward initializes it lazily, on the replay's fakes (a meta device it then
        # refuses to train on), and a real replay would gather the flat shards: a collective.
        return (
            f"{type(root).__name__} holds FullyShardedDataParallel (FSDP1) flat parameters: a "
            "replay would break its state, so FLOPs are not counted; give them with "
            "stepwatch.init(flops=<number | callable(batch)>) or flops.transformer_flops() "
            "(FSDP2 fully_shard is counted)"
        )
    return None


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def _fsdp_param_dtypes(root: Any) -> dict[int, Any]:
    """id(param) -> the dtype FSDP2 casts it to for compute (MixedPrecisionPolicy.param_dtype)."""
    out: dict[int, Any] = {}

    def walk(m: Any, dtype: Any) -> None:
        get_state = getattr(m, "_get_fsdp_state", None)
        if callable(get_state):
            try:
                pd = get_state()._mp_policy.param_dtype
                dtype = pd if pd is not None else dtype
            except (AttributeError, RuntimeError):
                pass
        if dtype is not None:
            for p in m.parameters(recurse=False):
                out[id(p)] = dtype
        for c in m.children():
            walk(c, dtype)

    walk(root, None)
    return out


def _fake_state(root: Any, fake_mode: Any) -> dict[str, Any]:
    import torch

    mp_dtypes = _fsdp_param_dtypes(root)
    state: dict[str, Any] = {}
    for name, p in root.named_parameters():
        if _is_dtensor(p):
            # Sharded (FSDP2): compute runs on the unsharded parameter of the global shape.
            with fake_mode:
                f = torch.empty(tuple(p.shape), dtype=mp_dtypes.get(id(p), p.dtype), device=p.device)
        else:
            f = fake_mode.from_tensor(p.detach(), static_shapes=True)
            if id(p) in mp_dtypes and mp_dtypes[id(p)] != p.dtype:
                with fake_mode:
                    f = f.to(mp_dtypes[id(p)])
        state[name] = f.requires_grad_(p.requires_grad)
    for name, b in root.named_buffers():
        if _is_dtensor(b):
            with fake_mode:
                state[name] = torch.empty(tuple(b.shape), dtype=b.dtype, device=b.device)
        else:
            state[name] = fake_mode.from_tensor(b, static_shapes=True)
    return state


def _real_state(root: Any, copies: bool) -> dict[str, Any]:
    """The real replay's parameters (detached aliases, or copies where ``copies``) and buffers
    (always copies: BatchNorm's running stats update in place, never the real ones)."""
    state: dict[str, Any] = {}
    for name, p in root.named_parameters():
        t = p.detach()
        state[name] = (t.clone() if copies else t).requires_grad_(p.requires_grad)
    for name, b in root.named_buffers():
        state[name] = b.clone()
    return state


class _WroteRealTensor(FlopCountError):
    """The real replay's forward tried to write a parameter or buffer of the user's model (the
    write was stopped before it ran)."""

    def __init__(self, name: str, parameter: bool) -> None:
        super().__init__(f"the forward writes {name!r} in place")
        self.name = name
        self.parameter = parameter


class FlopCountRefused(FlopCountError):
    """Not counted, on purpose: counting would have changed the user's model (see
    :func:`count_step_flops`); the message says why and what to do."""


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument that the aten op ``func`` writes (``Tensor(a!)``:
    in-place ops, ``out=``, ``_foreach_*_``)."""
    try:
        return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                     if a.alias_info is not None and a.alias_info.is_write)
    except AttributeError:  # not an aten op with a schema: nothing known to be written
        return ()


def _make_write_guard(root: Any) -> Any:
    """A dispatch mode for the real replay that stops any op writing into the storage of one of
    ``root``'s real parameters or buffers, before it runs: whichever tensor the write goes
    through (the replay's detached alias, ``.data``, a view, or a reference to the real tensor
    kept in a list). ``wrote`` is then ``(name, is_parameter)``. Costs a dict lookup per written
    argument; reads nothing else (the replay runs once per input signature)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def where(t: Any) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, AttributeError):  # no storage (sparse, nested)
            return None
        return (t.device, ptr) if ptr else None

    protected: dict[Any, tuple[str, bool]] = {}
    for name, t in root.named_parameters():
        k = where(t)
        if k is not None:
            protected.setdefault(k, (name, True))
    for name, t in root.named_buffers():
        k = where(t)
        if k is not None:
            protected.setdefault(k, (name, False))

    class _WriteGuard(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.wrote: tuple[str, bool] | None = None
            self._spots: dict[Any, tuple[tuple[int, str], ...]] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            spots = self._spots.get(func)
            if spots is None:
                spots = self._spots[func] = _written_args(func)
            for i, name in spots:
                v = args[i] if i < len(args) else kwargs.get(name)
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    hit = protected.get(where(t)) if isinstance(t, torch.Tensor) else None
                    if hit is not None:
                        self.wrote = hit  # kept: the forward may catch what we raise
                        raise _WroteRealTensor(*hit)
            return func(*args, **kwargs)

    return _WriteGuard()


def _free_bytes(device: Any) -> int | None:
    """Memory free for a copy on ``device``: the driver's free memory plus what torch's caching
    allocator holds unused (CUDA), ``MemAvailable`` (CPU, Linux); None where unknown."""
    import torch

    try:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        if device.type == "cpu":
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError, IndexError, AssertionError):
        return None
    return None


def _no_room_for_copies(root: Any) -> str | None:
    """None when a copy of each of ``root``'s parameters fits in half the free memory of its
    device; else what does not fit, said for the user."""
    need: dict[Any, int] = {}
    for p in root.parameters():
        need[p.device] = need.get(p.device, 0) + p.numel() * p.element_size()
    for device, n in need.items():
        free = _free_bytes(device)
        if free is None or 2 * n > free:
            have = "is unknown" if free is None else f"is {free / 2**30:.2f} GiB"
            return (f"a copy of its parameters ({n / 2**30:.2f} GiB on {device}) may take at most half "
                    f"of the memory free there, which {have}")
    return None


def _real_inputs(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().clone()
        if obj.requires_grad and (obj.is_floating_point() or obj.is_complex()):
            t.requires_grad_(True)
        return t
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_real_inputs(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_real_inputs(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _real_inputs(v) for k, v in obj.items()}
    return obj


def _fake_inputs(obj: Any, fake_mode: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        if _is_dtensor(obj):
            with fake_mode:
                f = torch.empty(tuple(obj.shape), dtype=obj.dtype, device=obj.device)
        else:
            f = fake_mode.from_tensor(obj.detach(), static_shapes=True)
        if obj.requires_grad and (obj.is_floating_point() or obj.is_complex()):
            f.requires_grad_(True)
        return f
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_fake_inputs(o, fake_mode) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fake_inputs(o, fake_mode) for o in obj)
    if isinstance(obj, dict):
        return {k: _fake_inputs(v, fake_mode) for k, v in obj.items()}
    if isinstance(obj, Mapping):
        try:
            return type(obj)({k: _fake_inputs(v, fake_mode) for k, v in obj.items()})
        except TypeError:
            return {k: _fake_inputs(v, fake_mode) for k, v in obj.items()}
    return obj


def _grad_outputs(obj: Any, out: list[Any]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and obj.grad_fn is not None:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _grad_outputs(o, out)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            _grad_outputs(o, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _grad_outputs(getattr(obj, name, None), out)


# Hooks whose replay would issue collectives or shard/unshard parameters: FSDP2 and composable
# replicate. They are set aside during the replay (their math is the identity; the parameters we
# feed are already the unsharded, compute-dtype fakes).
_DIST_HOOK_PREFIXES = ("torch.distributed.fsdp", "torch.distributed._composable")
# Hooks of other libraries that the replay's backward needs: transformers' and PEFT's
# ``enable_input_require_grads`` makes the embedding's output require grad, so that a checkpointed
# block over frozen embeddings has a backward.
_KEPT_HOOK_NAMES = frozenset({"make_inputs_require_grad"})


def _hook_function(h: Any) -> Any:
    import functools

    while isinstance(h, functools.partial):
        h = h.func
    return h


def _replays_with(h: Any, user_hooks: bool) -> bool:
    """Whether hook ``h`` runs in the replay: torch's own (weight_norm, pruning, quantization
    observers) and stepwatch's do, FSDP's never do, the user's only when ``user_hooks``."""
    f = _hook_function(h)
    origin = str(getattr(f, "__module__", "") or "")
    if origin.startswith(_DIST_HOOK_PREFIXES):
        return False
    if user_hooks or origin == "torch" or origin.startswith(("torch.", "stepwatch.")):
        return True
    return getattr(f, "__name__", None) in _KEPT_HOOK_NAMES


class _NotInReplay:
    """A global module hook of the user's, passed over on the thread that replays (the global
    dicts are the process's: another thread's forward still runs it)."""

    __slots__ = ("hook",)

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_counting():
            return None
        return self.hook(*args, **kwargs)


def _rng_kinds() -> tuple[tuple[type, Callable[[Any], Any], Callable[[Any, Any], Any]], ...]:
    """(class, get state, set state) of each random-number generator kind a module may hold:
    ``torch.Generator`` (CPU or CUDA), ``random.Random``, and numpy's ``Generator`` and
    ``RandomState`` where the job imported numpy (never imported here)."""
    import random

    import torch

    def set_bits(g: Any, s: Any) -> None:
        g.bit_generator.state = s

    kinds: list[Any] = [(torch.Generator, lambda g: g.get_state(), lambda g, s: g.set_state(s)),
                        (random.Random, lambda g: g.getstate(), lambda g, s: g.setstate(s))]
    np_random = getattr(sys.modules.get("numpy"), "random", None)
    gen_t, rs_t = getattr(np_random, "Generator", None), getattr(np_random, "RandomState", None)
    if isinstance(gen_t, type):
        kinds.append((gen_t, lambda g: g.bit_generator.state, set_bits))
    if isinstance(rs_t, type):
        kinds.append((rs_t, lambda g: g.get_state(), lambda g, s: g.set_state(s)))
    return tuple(kinds)


def _held_rng_states(modules: Any) -> list[tuple[Any, Callable[[Any, Any], Any], Any]]:
    """``(generator, set state, its state)`` for every random-number generator (see
    :func:`_rng_kinds`) that one of ``modules`` holds as an attribute, or as an element (a value)
    of a list, tuple or dict attribute; each generator once. One that cannot give its state
    (``random.SystemRandom``) is passed over: never an error (the caller runs inside the user's
    forward)."""
    try:
        kinds = _rng_kinds()
        types = tuple(k[0] for k in kinds)
    except Exception:  # noqa: BLE001 - nothing to restore rather than a failed count
        return []
    out: list[tuple[Any, Callable[[Any, Any], Any], Any]] = []
    seen: set[int] = set()

    def keep(g: Any) -> None:
        if id(g) in seen:
            return
        seen.add(id(g))
        for t, get, put in kinds:
            if isinstance(g, t):
                try:
                    out.append((g, put, get(g)))
                except Exception:  # noqa: BLE001 - no state to save (SystemRandom): left as it is
                    pass
                return

    for m in modules:
        for v in m.__dict__.values():
            if isinstance(v, types):
                keep(v)
            elif type(v) in (list, tuple):
                for e in v:
                    if isinstance(e, types):
                        keep(e)
            elif type(v) is dict:
                for e in v.values():
                    if isinstance(e, types):
                        keep(e)
    return out


def _set_rng_states(saved: list[tuple[Any, Callable[[Any, Any], Any], Any]]) -> None:
    """Put back what :func:`_held_rng_states` saved; a generator that refuses is left as it is."""
    for g, put, state in saved:
        try:
            put(g, state)
        except Exception:  # noqa: BLE001 - never raise where the user's forward runs
            pass


class _ModuleSnapshot:
    """Set aside distributed hooks and (unless ``user_hooks``) the user's own module hooks, and
    undo any attribute a module rebinds during the replay (a cache, a counter), so that no fake
    tensor leaks into the user's model and the user's hooks see only the user's own calls."""

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    _GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                          "_global_backward_pre_hooks", "_global_backward_hooks")

    def __init__(self, root: Any, user_hooks: bool = False) -> None:
        from torch.nn.modules import module as torch_module

        self.saved: list[tuple[Any, dict[str, Any]]] = []
        # Each module's parameters and buffers as they were: torch's functional_call(tie_weights=
        # True) swaps a module reached under two names (ALBERT-style sharing, an alias attribute,
        # Lightning Fabric's _FabricModule) once per name, and puts them back in the same order,
        # not the reverse: the second name's "original" was the replay's tensor, left in the
        # user's model (a FakeTensor for a parameter: the job's next loss.item() raised).
        self.tensors: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.hooks: list[tuple[Any, str, Any]] = []
        self.wrapped: list[tuple[Any, Any, Any, _NotInReplay]] = []
        self.user_hooks_set_aside = False
        # A list or dict the forward fills in place (an MoE's aux losses, a cache by name): its
        # contents, put back after the replay (a fake or back-propagated term left there failed
        # the user's backward). torch's own dicts (_parameters, hooks) are underscored.
        self.contents: list[tuple[Any, Any]] = []
        import torch

        data_parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
        for m in root.modules():
            self.saved.append((m, dict(m.__dict__)))
            for attr in ("_parameters", "_buffers"):
                d = m.__dict__.get(attr)
                if type(d) is dict and d:
                    self.tensors.append((d, dict(d)))
            if m is not root and isinstance(m, data_parallel):
                # DDP held by the called module (timm's ClassificationTask): the replay runs the
                # wrapped model, never DDP's own forward (its reducer's preparation, the buffer
                # broadcast, stepwatch's comm-hook registration, on fakes). ``restore`` removes it.
                m.__dict__["forward"] = m.module
            for k, v in m.__dict__.items():
                if type(v) is list or (type(v) is dict and not k.startswith("_")):
                    self.contents.append((v, v.copy()))
            for attr in self._HOOK_DICTS:
                d = getattr(m, attr, None)
                if not d:
                    continue
                keep = type(d)((k, h) for k, h in d.items() if _replays_with(h, user_hooks))
                if len(keep) != len(d):
                    self.user_hooks_set_aside |= any(
                        _replays_with(h, True) for k, h in d.items() if k not in keep)
                    self.hooks.append((m, attr, d))
                    object.__setattr__(m, attr, keep)
        # The random-number generators the modules hold (a noise generator of their own, a
        # LayerDrop's ``random.Random``): their states, put back after the replay, whose forward
        # drew from them (the default generators are restored by ``_replay``).
        self.rngs = _held_rng_states(m for m, _ in self.saved)
        if user_hooks:
            return
        for attr in self._GLOBAL_HOOK_DICTS:
            d = getattr(torch_module, attr, None)
            for k, h in list((d or {}).items()):
                if not _replays_with(h, False):
                    w = _NotInReplay(h)
                    d[k] = w
                    self.wrapped.append((d, k, h, w))
                    self.user_hooks_set_aside = True

    def swap_tensors(self, copy: Callable[[Any], Any]) -> None:
        """Give the replay ``copy(t)`` of each tensor a module holds as a plain attribute (not a
        parameter or buffer: a running mean kept by hand, a counter). An in-place update in the
        forward would otherwise reach the real one: the replay runs non-fake tensors for real, and
        training changed. ``restore`` puts the originals back. Tensors inside containers (a list
        on the module) and globals are not copied."""
        import torch

        for m, _ in self.saved:
            d = m.__dict__
            for k, v in list(d.items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    try:
                        d[k] = copy(v)
                    except Exception:  # noqa: BLE001 - a tensor that cannot be copied stays as it is
                        pass

    def restore(self) -> None:
        _set_rng_states(self.rngs)
        for d, before in self.tensors:
            for k, v in before.items():
                if d.get(k) is not v:
                    d[k] = v
        for v, before in self.contents:
            if type(v) is list:
                if len(v) != len(before) or any(a is not b for a, b in zip(v, before)):
                    v[:] = before
            elif v.keys() != before.keys() or any(v[k] is not b for k, b in before.items()):
                v.clear()
                v.update(before)
        for d, k, h, w in self.wrapped:
            if d.get(k) is w:
                d[k] = h
        for m, attr, d in self.hooks:
            object.__setattr__(m, attr, d)
        for m, before in self.saved:
            now = m.__dict__
            for k in list(now):
                if k not in before:
                    del now[k]
                elif now[k] is not before[k]:
                    now[k] = before[k]
            for k, v in before.items():
                if k not in now:
                    now[k] = v


# A forward that deepcopies a module (a lazily made target network) reads each fake tensor's data
# pointer: torch's warning blames the user's code, which without the replay never warns; under
# warnings-as-errors the copy failed half way.
_FAKE_DATA_POINTER = ("ignore", re.compile(re.escape("Accessing the data pointer of FakeTensor"), re.I), UserWarning,
                      None, 0)


@contextlib.contextmanager
def _ignoring_fake_data_pointers() -> Iterator[None]:
    """The replay's own warning (``_FAKE_DATA_POINTER``) ignored while it runs. Put in and taken out
    of ``warnings.filters`` in place: ``warnings.catch_warnings()`` and ``filterwarnings()`` mark
    the filters changed, which empties every module's shown-once registry, and the job's own
    warnings (its loop's, its model's, which the replay runs again) then showed again after each
    count."""
    filters = warnings.filters
    filters.insert(0, _FAKE_DATA_POINTER)
    try:
        yield
    finally:
        try:
            filters.remove(_FAKE_DATA_POINTER)
        except ValueError:  # the forward replaced the filters (its own catch_warnings): nothing of ours
            pass


def count_step_flops(
    module: Any,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    backward: bool | None = None,
    lint_devices: tuple[str, ...] = ("cuda",),
    real: bool = False,
) -> FlopCount:
    """FLOPs of one call ``module(*args, **kwargs)`` and its backward, on fake tensors.

    ``real=True`` replays on real tensors instead (the fallback when a fake replay cannot run:
    data-dependent ops such as ``nn.TransformerEncoder(..., mask=...)``'s nested-tensor check):
    one real forward and backward, on detached aliases of the parameters (their ``.grad`` and
    autograd hooks untouched), clones of the buffers and inputs, with the RNG state restored. It
    costs one extra forward/backward of compute, once per input signature. A write into a real
    parameter or buffer (by any tensor sharing its storage, under ``no_grad`` too) is stopped
    before it runs; the replay then runs once more on copies of the parameters if they fit in
    half the free memory of their device, else raises ``FlopCountRefused`` (see the module's
    docstring), as it does when the write goes through a reference that no copy replaces.

    ``module`` may be wrapped in DDP / DataParallel / ``torch.compile``; FSDP2 (``fully_shard``)
    modules are counted on unsharded fakes of each parameter (in the mixed-precision
    ``param_dtype``) with FSDP's hooks set aside, so the replay issues no collective and every
    rank counts its own micro-batch. ``loss_fn(output) -> scalar`` seeds the backward from a
    loss; by default the backward is seeded with ``ones_like`` of every differentiable output.
    ``backward=None`` runs it when grad mode is enabled. Call it from the training thread (it
    temporarily swaps fakes into the module). Raises ``FlopCountError`` when the replay fails.

    The replay runs inside an autograd node on this thread (:func:`_in_autograd_node`), so that it
    leaves no thread-local state behind that every later backward would pay for. Anomaly mode
    (``torch.autograd.set_detect_anomaly``, a process-wide switch) is off while it runs: its checks
    read values, which fake tensors do not have, and each failure printed a warning that looked
    like the user's own backward failing. The user's dispatch modes (a ``FlopCounterMode`` of
    their own around the step) are set aside while it runs: they counted the replay too. What
    torch's fake-tensor logger says on this thread meanwhile is dropped: a forward that fails on
    fakes (a malformed batch the loop catches) printed an ERROR traceback there. So are the
    user's ``saved_tensors_hooks`` (activation offload): the replay called their pack hook.
    """
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addFilter(_QUIET_REPLAY)
    try:
        with torch.autograd.set_detect_anomaly(False), _disable_current_modes(), _labelled_for_the_jobs_profiler(), \
                _own_saved_tensors():
            return _in_autograd_node(
                lambda: _count(module, args, kwargs, loss_fn=loss_fn, backward=backward, lint_devices=lint_devices, real=real)
            )
    finally:
        fake_log.removeFilter(_QUIET_REPLAY)


def _same(t: Any) -> Any:
    return t


def _own_saved_tensors() -> Any:
    """While the user's ``saved_tensors_hooks`` are in force, hooks of the replay's own on top of
    them (the innermost pair is the one autograd calls): tensors saved as they are. Nothing to do
    when there are none, or when the user disabled such hooks (pushing would raise)."""
    import contextlib

    import torch

    auto = torch._C._autograd
    try:
        if auto._top_saved_tensors_default_hooks(True) is None or not auto._saved_tensors_hooks_is_enabled():
            return contextlib.nullcontext()
    except (AttributeError, TypeError):  # another torch: as before
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


class _QuietReplay(logging.Filter):
    """Drops a log record made on a thread that is replaying (see :func:`count_step_flops`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_counting()


_QUIET_REPLAY = _QuietReplay()


def _in_autograd_node(fn: Callable[[], Any]) -> Any:
    """``fn()``, run on this thread inside a node of a one-node CPU backward, with this thread's
    grad mode; what it raises is raised here.

    Why: a fake-tensor replay creates functorch's thread-local state on the thread it runs on, and
    from then on torch deep-copies that state at every node of every backward on that thread
    (``ThreadLocalStateGuard`` in the engine's ``thread_main``): ~1000 instructions a node, counted
    with callgrind, for the rest of the job. The engine runs a CPU graph on the calling thread and
    restores the thread's whole ``ThreadLocalState`` after each node, so what ``fn`` created is
    dropped when it returns, and everything else the thread had (autocast, modes, saved-tensor
    hooks, the default device) is the caller's while it runs. In inference mode no graph can be
    built: ``fn()`` runs as it is."""
    import torch

    if torch.is_inference_mode_enabled():
        return fn()
    from torch.autograd.graph import _engine_run_backward

    grad = torch.is_grad_enabled()
    out: list[Any] = []
    failed: list[BaseException] = []

    def run(_grad: Any) -> None:
        try:
            with torch.set_grad_enabled(grad):  # a backward node runs with grad off
                out.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again below, outside the engine
            failed.append(e)

    with torch.enable_grad():
        node = torch.zeros((), device="cpu", requires_grad=True).clone()  # CPU: the engine runs it on this thread
    node.register_hook(run)
    _engine_run_backward((node,), (torch.ones((), device="cpu"),), False, False, (), allow_unreachable=True, accumulate_grad=True)
    # The node's hook (``run``) is held by the autograd graph, a reference gc cannot follow: an
    # exception left in ``failed`` would keep its traceback's frames (the training loop's, with its
    # model and batch) alive for good. Nothing of ours stays reachable from the node.
    del node
    if failed:
        e = failed.pop()
        raise e
    if not out:  # the hook did not run: no engine node here after all
        return fn()
    return out.pop()


def _count(
    module: Any,
    args: Any,
    kwargs: Mapping[str, Any] | None,
    *,
    loss_fn: Callable[[Any], Any] | None,
    backward: bool | None,
    lint_devices: tuple[str, ...],
    real: bool,
) -> FlopCount:
    import torch

    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping or None, got {type(kwargs).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    root = unwrap_module(module)
    if not isinstance(root, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    why = _never_replay(root)
    if why is not None:
        raise FlopCountError(why)
    if backward is None:
        backward = torch.is_grad_enabled()
    from torch.nn.parameter import UninitializedParameter

    if any(isinstance(p, UninitializedParameter) for p in root.parameters()):
        raise FlopCountNotReady("lazy modules are not initialized until their first real forward")

    if real and any(_is_dtensor(t) for t in (*root.parameters(), *root.buffers())):
        raise FlopCountError(f"could not count FLOPs of {type(root).__name__}: sharded parameters")
    user_hooks = copies = False
    while True:  # at most 4 tries: each failure below turns one flag on, or raises
        try:
            with _ignoring_fake_data_pointers():
                return _replay(root, args, kwargs, loss_fn=loss_fn, backward=backward, lint_devices=lint_devices,
                               real=real, user_hooks=user_hooks, copies=copies)
        except _FailedWithoutHooks:
            if user_hooks:  # pragma: no cover - raised only while some hooks are set aside
                raise
            # A hook of the user's the forward needs (one that casts or moves the input): run them too.
            user_hooks = True
        except _WroteRealTensor as e:
            # The forward writes its parameters (a momentum encoder, a running statistic, a clamp):
            # stopped before it landed. Again on copies of the parameters, where they fit.
            head = (f"FLOPs of {type(root).__name__} are not counted (training is untouched): it cannot "
                    f"run on fake tensors, and its forward writes {e.name!r} in place")
            tail = "Give the FLOPs yourself (stepwatch.init(flops=<number | callable(batch)>)) to get MFU."
            if copies or not e.parameter:
                raise FlopCountRefused(
                    f"{head} through a reference that the replay cannot swap for a copy (a list or a "
                    f"closure holding the real tensor). {tail}") from None
            no_room = _no_room_for_copies(root)
            if no_room is not None:
                raise FlopCountRefused(f"{head}, so it may be replayed only on copies, and {no_room}. {tail}") from None
            copies = True


class _FailedWithoutHooks(FlopCountError):
    """The replay failed with some of the user's hooks set aside."""


def _replay(
    root: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    loss_fn: Callable[[Any], Any] | None,
    backward: bool,
    lint_devices: tuple[str, ...],
    real: bool,
    user_hooks: bool,
    copies: bool = False,
) -> FlopCount:
    import random

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    py_rng = random.getstate()
    np_random = getattr(sys.modules.get("numpy"), "random", None)  # imported by the job, not by us
    np_rng = np_random.get_state() if np_random is not None else None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    counter = _make_counter(tuple(lint_devices))
    snapshot = _ModuleSnapshot(root, user_hooks)
    stance = _force_eager()
    guard: Any = None
    set_counting(True)
    try:
        if real:
            # In place of the fake mode: no write reaches the user's parameters or buffers.
            fake_mode = guard = _make_write_guard(root)
            state = _real_state(root, copies)
            fargs = _real_inputs(args)
            fkwargs = _real_inputs(dict(kwargs))
            snapshot.swap_tensors(_real_inputs)
        else:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            state = _fake_state(root, fake_mode)
            fargs = _fake_inputs(args, fake_mode)
            fkwargs = _fake_inputs(dict(kwargs), fake_mode)
            snapshot.swap_tensors(lambda t: _fake_inputs(t, fake_mode))
        # The backward runs inside the same functional_call as the forward, with the replay's
        # parameters still in place: a reentrant checkpoint runs its block's forward again inside
        # backward, on whatever parameters the block holds then (the real ones, once
        # functional_call has returned: the replay's gradients would land in the user's .grad).
        replay = _replay_call(root, loss_fn, backward, counter)
        with stance, fake_mode, counter:
            functional_call(replay, {f"root.{k}": v for k, v in state.items()}, (fargs, fkwargs),
                            tie_weights=True, strict=False)
        if guard is not None and guard.wrote is not None:
            raise _WroteRealTensor(*guard.wrote)  # the forward caught ours: still no count
    except Exception as e:  # the user's forward can fail on fakes in many ways; report, never raise raw
        if guard is not None and guard.wrote is not None:
            raise _WroteRealTensor(*guard.wrote) from None
        raise (_FailedWithoutHooks if snapshot.user_hooks_set_aside else FlopCountError)(
            f"could not count FLOPs of {type(root).__name__} on {'real' if real else 'fake'} tensors: {type(e).__name__}: {e}. "
            "Give the FLOPs yourself (stepwatch.init(flops=<number | callable(batch)>)) to get MFU."
        ) from e
    finally:
        set_counting(False)
        snapshot.restore()
        torch.set_rng_state(cpu_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            np_random.set_state(np_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    b = counter.buckets
    return FlopCount(b["forward"], b["backward"], b["recompute"], tuple(counter.alignment), counter.tf32_sensitive)


REPLAY_RANGE = "stepwatch: FLOP count (a replay of the forward and backward, not the job's work)"


def _labelled_for_the_jobs_profiler() -> Any:
    """While the job's own profiler records (``torch.profiler.profile`` around its loop), the
    replay's ops land in its trace: torch offers no way to keep them out. They are put inside one
    range, :data:`REPLAY_RANGE`, that says whose they are. Otherwise nothing (no cost)."""
    import contextlib

    import torch

    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(REPLAY_RANGE)


def _replay_call(root: Any, loss_fn: Callable[[Any], Any] | None, backward: bool, counter: Any) -> Any:
    """A module holding ``root`` whose call is the whole replay: the forward, ``loss_fn``, and the
    backward from ``ones_like`` of every differentiable output. Given to ``functional_call``
    with the replay's state under ``root.``, so that everything it runs, backward included,
    sees the replay's parameters and buffers. One class for every replay: a class made per replay
    (a closure over ``root``) is a reference cycle, and it kept each replayed model alive after
    the script dropped it, until a full cyclic collection (a sweep held every trial's model)."""
    global _REPLAY_CALL
    if _REPLAY_CALL is None:
        _REPLAY_CALL = _replay_call_class()
    return _REPLAY_CALL(root, (loss_fn, backward, counter))


_REPLAY_CALL: Any = None


def _replay_call_class() -> type:
    import torch

    @replay_module
    class ReplayCall(torch.nn.Module):
        def __init__(self, root: Any, how: tuple[Any, bool, Any]) -> None:
            super().__init__()
            self.root = root  # its state is the replay's under "root."
            self.how = how  # (loss_fn, backward, counter) in a tuple: a loss module is no child of this one

        def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            """The replay; returns an empty tensor, no FLOPs: with a global full backward hook of
            the user's, torch warned in the job's log that this module's output was None."""
            loss_fn, backward, counter = self.how
            out = self.root(*args, **kwargs)
            if loss_fn is not None:
                out = loss_fn(out)
            if backward:
                outs: list[Any] = []
                _grad_outputs(out, outs)
                if outs:
                    counter.phase = "backward"
                    seeds = [torch.ones_like(o) for o in outs]
                    # Every leaf in this graph is one of the replay's: grads accumulate there, never
                    # into a real .grad. The engine is called directly so that wrappers of
                    # torch.autograd.backward (stepwatch's own backward timer) do not see the replay.
                    _run_backward(outs, seeds)
            return torch.empty(0)

    return ReplayCall


def _run_backward(outs: list[Any], seeds: list[Any]) -> None:
    try:
        from torch.autograd.graph import _engine_run_backward
    except ImportError:  # pragma: no cover - older torch
        import torch

        torch.autograd.backward(outs, seeds)
        return
    _engine_run_backward(tuple(outs), tuple(seeds), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _force_eager() -> Any:
    """Compiled regions (``module.compile()``, ``torch.compile``d functions) run eagerly in the
    replay: dynamo must not trace, guard on or cache fake tensors."""
    import contextlib

    import torch

    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    try:
        return set_stance("force_eager")
    except (RuntimeError, TypeError, ValueError):
        return contextlib.nullcontext()


# ----------------------------------------------------------------------------- cache


def _sig(obj: Any, out: list[Any], tensor: type, depth: int = 0) -> None:
    # Hot path (every forward): a flat list of what changes the FLOPs. Tensors by shape and dtype;
    # small scalars by value (a `seq_len=` kwarg changes the count); anything else by type.
    if isinstance(obj, tensor):
        out.append((obj.shape, obj.dtype, obj.device.type, obj.requires_grad))
        return
    t = type(obj)
    if obj is None or t in (int, float, bool, str):
        out.append(obj)
    elif depth > 4:
        out.append(t)
    elif isinstance(obj, (list, tuple)):
        out.append(len(obj))
        for o in obj:
            _sig(o, out, tensor, depth + 1)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.append(k)
            _sig(v, out, tensor, depth + 1)
    else:
        out.append(t)


# The fast path: what ``FlopCache.key`` reads, compared without building the key. A call whose
# arguments are a flat tuple (and keyword dict) of tensors and small scalars is described once,
# at the slow lookup, as a tuple of per-argument descriptors; the next call with the same module
# compares its arguments against it element by element (shape, dtype, device kind, grad) and the
# global state (grad mode, autocast, TF32 switches) against the one kept. Anything else (nested
# containers, other objects, a device that is neither CPU nor CUDA) takes the slow path. The TF32
# switches are kept (and read at each call) only for a count they can change
# (``FlopCount.tf32_sensitive``): two calls into torch that cost about a microsecond a forward.
_SCALARS = (int, float, bool, str)
_GETTERS: Any = None  # (torch, any autocast, grad mode, the two TF32 switches), bound once


def _getters() -> Any:
    global _GETTERS
    import torch

    C = torch._C
    if hasattr(C, "_get_cublas_allow_tf32") and hasattr(C, "_get_cudnn_allow_tf32"):
        tf_a, tf_b = C._get_cublas_allow_tf32, C._get_cudnn_allow_tf32
    else:
        def tf_a() -> Any:
            return torch.backends.cuda.matmul.allow_tf32

        def tf_b() -> Any:
            return torch.backends.cudnn.allow_tf32

    _GETTERS = (torch, C._is_any_autocast_enabled, C.is_grad_enabled, tf_a, tf_b)
    return _GETTERS


def _state(tf32: bool = True) -> Any:
    """What ``FlopCache.key`` reads of the global state, as one comparable value: (grad mode,
    autocast, the two TF32 switches), the switches None unless ``tf32``."""
    torch, any_autocast, grad, tf_a, tf_b = _GETTERS or _getters()
    if any_autocast():
        auto: Any = tuple(
            (dev, torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu") if torch.is_autocast_enabled(dev)
        )
    else:
        auto = False
    if not tf32:
        return (grad(), auto, None, None)
    return (grad(), auto, tf_a(), tf_b())


_NO = object()


def _describe(obj: Any) -> Any:
    """One argument's descriptor for the fast path, or ``_NO`` if it needs the slow path:
    a tensor as (class, shape, dtype, on CUDA, requires grad), a small scalar as (class, value)."""
    torch = (_GETTERS or _getters())[0]
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            return (type(obj), obj.shape, obj.dtype, True, obj.requires_grad)
        if obj.is_cpu:
            return (type(obj), obj.shape, obj.dtype, False, obj.requires_grad)
        return _NO  # another device kind: the slow path keeps its name
    if obj is None or type(obj) in _SCALARS:
        return (type(obj), obj)
    return _NO


def _fast_sig(args: Any) -> tuple[Any, ...] | None:
    if type(args) is not tuple:
        return None
    out = tuple(_describe(a) for a in args)
    return None if any(d is _NO for d in out) else out


def _fast_kw(kwargs: Any) -> tuple[Any, ...] | None:
    if not kwargs:
        return ()
    if type(kwargs) is not dict:
        return None
    out = tuple((k, _describe(v)) for k, v in kwargs.items())
    return None if any(d is _NO for _, d in out) else out


class _PySigCore:
    """``CallSig``'s descriptors and its comparison in Python: the reference that
    metrics/_cmetrics.c's ``SigCore`` translates line for line, and the one used where that
    extension was not built."""

    __slots__ = ("state", "args", "kwargs", "single", "flat", "keys")

    def matches(self, args: Any, kwargs: Any) -> bool:
        d = self.single
        if d is not None:
            a = args[0] if type(args) is tuple and len(args) == 1 and not kwargs else None
            if not (type(a) is d[0] and a.dtype is d[2] and a.shape == d[1] and a.requires_grad is d[4]
                    and (a.is_cuda if d[3] else a.is_cpu)):
                return False
        else:
            if type(args) is not tuple:
                return False
            if kwargs:
                if type(kwargs) is not dict or tuple(kwargs) != self.keys:
                    return False
                values = args + tuple(kwargs.values())
            elif self.keys:
                return False
            else:
                values = args
            flat = self.flat
            if len(values) != len(flat):
                return False
            for a, d in zip(values, flat):
                if type(a) is not d[0]:
                    return False
                if len(d) == 2:
                    if a != d[1]:  # same class, so 1 and True, 1.0 and 1 are told apart
                        return False
                elif not (a.dtype is d[2] and a.shape == d[1] and (a.is_cuda if d[3] else a.is_cpu)
                          and a.requires_grad is d[4]):
                    return False
        torch, any_autocast, grad, tf_a, tf_b = _GETTERS or _getters()
        st = self.state
        if st[1] is not False or any_autocast():
            return st == _state(st[2] is not None)
        return grad() == st[0] and (st[2] is None or (tf_a() == st[2] and tf_b() == st[3]))


try:  # the comparison in C (metrics/_cmetrics.c): the same answers, less time a forward
    from . import _cmetrics

    _SigCore: Any = _cmetrics.SigCore
    _cmetrics._bind(globals())
except ImportError:  # not built here (no compiler): the Python above
    _SigCore = _PySigCore


class _SigMethods:
    """``CallSig``'s construction, shared by its two cores."""

    __slots__ = ()

    def __init__(self, state: Any, args: tuple[Any, ...], kwargs: tuple[Any, ...]) -> None:
        self.state = state
        self.args = args
        self.kwargs = kwargs
        self.single = args[0] if len(args) == 1 and not kwargs and len(args[0]) == 5 else None
        self.flat = args + tuple(d for _, d in kwargs)  # positional descriptors, then keyword ones
        self.keys = tuple(k for k, _ in kwargs)

    @classmethod
    def of(cls, args: Any, kwargs: Any, tf32: bool = True) -> Any:
        """The signature of a call, or None; ``tf32``: whether the TF32 switches are part of it
        (False for a count they cannot change)."""
        targs, tkw = _fast_sig(args), _fast_kw(kwargs)
        return None if targs is None or tkw is None else cls(_state(tf32), targs, tkw)


class CallSig(_SigMethods, _SigCore):  # type: ignore[misc,valid-type]
    """One call's signature for the last-call fast paths (``FlopCache``, the throughput
    collector): the global state and a flat description of the arguments. ``of`` is None for a
    call the description cannot hold (nested containers, other devices); ``matches`` says
    whether another call has the same signature: its positional and keyword values compared in
    one loop against the descriptors, a lone tensor (``model(x)``) without the loop, then the
    global state without building it (a new state value only when autocast is on). The
    comparison is C where metrics/_cmetrics.c was built, else :class:`_PySigCore`'s."""

    __slots__ = ()


class PyCallSig(_SigMethods, _PySigCore):
    """``CallSig`` with the Python comparison always (tests compare the two)."""

    __slots__ = ()


_SEEN = 8  # per skeleton: the replays a new law is looked for among, and at most this many laws
_MAX_ENTRIES = 1 << 16  # counts kept; a computed one past it is computed again at its next miss
_BUCKETS = ("forward", "backward", "recompute")


def _shape_parts(key: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    """A cache key split into its skeleton (each tensor's shape as its rank) and its sizes, in
    order; None when it holds no tensor."""
    import torch

    skeleton: list[Any] = []
    dims: list[int] = []
    for p in key:
        if type(p) is tuple and len(p) == 4 and type(p[0]) is torch.Size:
            skeleton.append((len(p[0]), *p[1:]))
            dims.extend(p[0])
        else:
            skeleton.append(p)
    return (tuple(skeleton), tuple(dims)) if dims else None


class _Law:
    """The FLOPs of one call along the sizes that change while all else stays: the sequence length
    under dynamic padding (every place it appears, ``input_ids``, ``attention_mask`` and
    ``labels`` alike, holds the same value), or two, a seq2seq batch's source and target lengths
    padded apart, or a token-budget sampler's batch and length. Each count is a polynomial of
    degree <= 2 in each size (matmuls linear in a length, attention's score matrix quadratic,
    cross-attention the product of the two, a batch times a length squared): 3 coefficients for
    one size, 9 for two. Replays give points; once the points determine the polynomial (3, or 9
    that no lower-degree curve passes through), one more replay must get its count exactly from
    it before the law computes any. Then sizes each within a factor 2 of its checked range are
    computed; a call further out is replayed, and must agree again (the range grows to it), or
    the law is dropped for good (a model whose work jumps at some size: every size is replayed
    from then on, as without a law). A jump between two checked sizes is not seen: there the
    law's number stands (docs/mfu.md)."""

    __slots__ = ("groups", "fixed", "points", "lo", "hi", "basis", "inverse", "checked", "broken")

    MAX_POINTS = 32  # kept while the polynomial is not yet determined (the replay budget's size)

    def __init__(self, groups: tuple[tuple[int, ...], ...], fixed: tuple[int | None, ...]) -> None:
        self.groups = groups  # per changing size: its positions among the key's sizes
        self.fixed = fixed  # every other size, None at those positions
        self.points: list[tuple[tuple[int, ...], FlopCount]] = []
        self.lo: tuple[int, ...] = ()  # the checked range, per size
        self.hi: tuple[int, ...] = ()
        self.basis: list[int] = []  # the points the polynomial is solved from
        self.inverse: list[list[Any]] | None = None  # of their monomial matrix
        self.checked = self.broken = False

    @classmethod
    def between(cls, a: tuple[int, ...], b: tuple[int, ...]) -> "_Law | None":
        """A law from two replays whose sizes differ in one or two values (the positions that
        differ, grouped by their pair of values: one group per changing size), else None."""
        if len(a) != len(b):
            return None
        pairs: dict[tuple[int, int], list[int]] = {}
        for i in range(len(a)):
            if a[i] != b[i]:
                pairs.setdefault((a[i], b[i]), []).append(i)
        if not 1 <= len(pairs) <= 2:
            return None
        groups = tuple(tuple(g) for g in pairs.values())
        moving = {i for g in groups for i in g}
        return cls(groups, tuple(None if i in moving else v for i, v in enumerate(a)))

    def size_of(self, dims: tuple[int, ...]) -> tuple[int, ...] | None:
        """The changing sizes in these sizes, or None when they are not on this law's plane."""
        if len(dims) != len(self.fixed):
            return None
        for i, v in enumerate(self.fixed):
            if v is not None and dims[i] != v:
                return None
        xs = []
        for g in self.groups:
            x = dims[g[0]]
            for i in g:
                if dims[i] != x:
                    return None
            xs.append(x)
        return tuple(xs)

    def covers(self, xs: tuple[int, ...]) -> bool:
        return (self.checked and not self.broken
                and all(2 * x >= lo and x <= 2 * hi for x, lo, hi in zip(xs, self.lo, self.hi)))

    def add(self, xs: tuple[int, ...], count: FlopCount) -> None:
        """A replay's count at sizes ``xs``: a point; once the polynomial is determined, each
        further point checks it (the first one makes the law usable; a later one, outside the
        range computed, checks it again and grows the range)."""
        if self.broken:
            return
        if self.inverse is not None:
            guess = self.predict(xs)
            if guess is None or any(getattr(guess, b) != getattr(count, b) for b in _BUCKETS):
                self._break()
                return
            self.points.append((xs, count))
            del self.points[self.MAX_POINTS:]
            self._checked_range(xs)
            return
        if len(self.points) >= self.MAX_POINTS:  # sizes that never determine it: no law
            self._break()
            return
        self.points.append((xs, count))
        self._solve()

    def _break(self) -> None:
        self.broken = True
        self.points.clear()
        self.inverse = None

    def _monomials(self, xs: tuple[int, ...]) -> list[int]:
        """x^i (one size), or x^i * y^j (two), for i, j in 0..2."""
        if len(xs) == 1:
            return [1, xs[0], xs[0] * xs[0]]
        x, y = xs
        return [x**i * y**j for i in range(3) for j in range(3)]

    def _solve(self) -> None:
        """Choose points whose monomial rows are independent (in order), and, once they determine
        the polynomial, invert their matrix exactly; the points after them check it."""
        from fractions import Fraction

        n = 3 ** len(self.groups)
        rows: list[list[Fraction]] = []  # the chosen rows, reduced (echelon form, for the rank)
        basis: list[int] = []
        for k, (xs, _) in enumerate(self.points):
            r = [Fraction(v) for v in self._monomials(xs)]
            for row in rows:
                lead = next(j for j, v in enumerate(row) if v)
                if r[lead]:
                    f = r[lead] / row[lead]
                    r = [u - f * v for u, v in zip(r, row)]
            if any(r):
                rows.append(r)
                basis.append(k)
                if len(basis) == n:
                    break
        if len(basis) < n:
            return
        m = [[Fraction(v) for v in self._monomials(self.points[k][0])] for k in basis]
        inv = [[Fraction(int(i == j)) for j in range(n)] for i in range(n)]
        for c in range(n):  # Gauss-Jordan on [m | I]: m is invertible (its rows are independent)
            p = next(r for r in range(c, n) if m[r][c])
            m[c], m[p], inv[c], inv[p] = m[p], m[c], inv[p], inv[c]
            f = m[c][c]
            m[c] = [v / f for v in m[c]]
            inv[c] = [v / f for v in inv[c]]
            for r in range(n):
                if r != c and m[r][c]:
                    g = m[r][c]
                    m[r] = [u - g * v for u, v in zip(m[r], m[c])]
                    inv[r] = [u - g * v for u, v in zip(inv[r], inv[c])]
        self.basis, self.inverse = basis, inv
        checks = [p for k, p in enumerate(self.points) if k not in basis]
        for xs, count in checks:  # replays already taken: each must agree
            guess = self.predict(xs)
            if guess is None or any(getattr(guess, b) != getattr(count, b) for b in _BUCKETS):
                self._break()
                return
        for xs, _ in checks:
            self._checked_range(xs)

    def _checked_range(self, xs: tuple[int, ...]) -> None:
        """A check passed at ``xs``: the law is usable, over a range that takes in every point."""
        if not self.checked:
            self.checked = True
            pts = [p[0] for p in self.points]
            self.lo = tuple(min(c) for c in zip(*pts))
            self.hi = tuple(max(c) for c in zip(*pts))
        self.lo = tuple(min(a, b) for a, b in zip(self.lo, xs))
        self.hi = tuple(max(a, b) for a, b in zip(self.hi, xs))

    def predict(self, xs: tuple[int, ...]) -> FlopCount | None:
        """The count at sizes ``xs`` from the polynomial; None where it is not a whole number >= 0
        (no such law), or before it is determined. Whether the law may be trusted there is
        ``covers``'s."""
        if self.inverse is None:
            return None
        v = self._monomials(xs)
        n = len(v)
        # The count is a weighted sum of the basis points' counts: weights = v . inverse.
        weights = [sum(v[i] * self.inverse[i][j] for i in range(n)) for j in range(n)]
        pts = [self.points[k][1] for k in self.basis]
        out: dict[str, dict[str, int]] = {}
        for b in _BUCKETS:
            keys = {k for c in pts for k in getattr(c, b)}
            got: dict[str, int] = {}
            for k in sorted(keys):
                total = sum(w * getattr(c, b).get(k, 0) for w, c in zip(weights, pts))
                if total.denominator != 1 or total < 0:
                    return None
                if total:
                    got[k] = int(total)
            out[b] = got
        return FlopCount(out["forward"], out["backward"], out["recompute"], (),
                         any(c.tf32_sensitive for c in pts))


class FlopCache:
    """FLOPs per input signature: counted on the first call with a new signature, then looked up.

    The key is the module, the shapes/dtypes of the tensor arguments, small scalar arguments, the
    autocast state and the TF32 switches, and grad mode. Shapes that never repeat (dynamic padding
    to the longest sequence) would mean a replay every step, ~1 s each for a 12-layer GPT-2 on
    fakes: where one or two sizes alone change (each the same value in every place it appears),
    the counts follow a :class:`_Law` once a replay agrees with it (the 4th with one size, the
    10th or so with two), and new sizes are computed instead of replayed. Past ``max_misses`` replays new signatures that no law covers are not counted (their
    FLOPs are None) and one line says how to give the FLOPs instead. A signature whose count
    failed is remembered as None (no retry). ``replays``, ``replay_ns`` and ``predicted`` say what
    it cost (run.json's ``training_metrics``).
    """

    def __init__(
        self,
        *,
        max_misses: int = 32,
        counter: Callable[..., FlopCount] = count_step_flops,
        **count_kwargs: Any,
    ) -> None:
        if isinstance(max_misses, bool) or not isinstance(max_misses, int) or max_misses < 1:
            raise ValueError(f"max_misses must be an integer >= 1, got {max_misses!r}")
        self.max_misses = max_misses
        self._counter = counter
        self._count_kwargs = count_kwargs
        self._entries: dict[tuple[Any, ...], FlopCount | None] = {}
        # Last-signature fast path: per module, its last call's signature and value.
        self._last: dict[int, tuple[CallSig, FlopCount | None]] = {}
        self.misses = 0
        self.errors = 0
        self._unsaid: dict[tuple[Any, ...], str] = {}  # failed counts, said at their signature's next call
        self._gen: dict[int, int] = {}  # per module: how often its trainable parameters changed (retrain)
        # Laws of one or two sizes (see _Law), by the key's skeleton (its shapes as their ranks), and the
        # replays of each skeleton a new law is looked for among (the last _SEEN).
        self._laws: dict[tuple[Any, ...], list[_Law]] = {}
        self._seen: dict[tuple[Any, ...], list[tuple[tuple[int, ...], FlopCount]]] = {}
        self.replays = 0  # counts run (fake or real), failed ones too
        self.replay_ns = 0  # their time
        self.predicted = 0  # signatures a law computed
        self._computed: set[tuple[Any, ...]] = set()  # the keys of computed counts (no part of max_misses)

    @staticmethod
    def key(module: Any, args: Any, kwargs: Mapping[str, Any] | None) -> tuple[Any, ...]:
        import torch

        parts: list[Any] = [id(module), torch.is_grad_enabled()]
        for dev in ("cuda", "cpu"):
            if torch.is_autocast_enabled(dev):
                parts.append((dev, torch.get_autocast_dtype(dev)))
        # The C getters behind torch.backends.{cuda.matmul,cudnn}.allow_tf32, 10x cheaper.
        C = torch._C
        parts.append(C._get_cublas_allow_tf32() if hasattr(C, "_get_cublas_allow_tf32") else torch.backends.cuda.matmul.allow_tf32)
        parts.append(C._get_cudnn_allow_tf32() if hasattr(C, "_get_cudnn_allow_tf32") else torch.backends.cudnn.allow_tf32)
        _sig(args, parts, torch.Tensor)
        if kwargs:
            _sig(kwargs, parts, torch.Tensor)
        return tuple(parts)

    def get(self, module: Any, args: Any, kwargs: Mapping[str, Any] | None = None, **count_kwargs: Any) -> FlopCount | None:
        """The FLOPs of this call (training thread); counts on a miss. Never raises for a failed count.

        Returns None when called from inside a replay (a hook on the module firing during it)."""
        if is_counting():
            return None
        mid = id(module)
        last = self._last.get(mid)
        if last is not None and not count_kwargs and last[0].matches(args, kwargs):
            return last[1]
        key = self.key(module, args, kwargs)
        gen = self._gen.get(mid)
        if gen:
            key = (*key, gen)
        try:
            value = self._entries[key]
        except KeyError:
            pass
        else:
            if value is None and key in self._unsaid:
                msg = self._unsaid.pop(key)
                warn_once(f"flops.error.{msg}", "stepwatch: %s", msg, log=log)
            if not count_kwargs:
                self._remember(mid, args, kwargs, value)
            return value
        shape = _shape_parts(key)
        if shape is not None:
            value = self._computed_by_law(*shape)
            if value is not None:
                self.predicted += 1
                if len(self._entries) < _MAX_ENTRIES:
                    self._entries[key] = value
                    self._computed.add(key)
                if not count_kwargs:
                    self._remember(mid, args, kwargs, value)
                return value
        if self.misses >= self.max_misses:
            warn_once(
                "flops.budget",
                "stepwatch: input shapes changed %d times; FLOPs of new shapes are not counted "
                "(MFU is null for them). Pad to a few fixed lengths, or give the FLOPs: "
                "stepwatch.init(flops=<number | callable(batch)>) or flops.transformer_flops().",
                self.max_misses, log=log,
            )
            return None
        kw = {**self._count_kwargs, **count_kwargs}
        t0 = time.perf_counter_ns()
        try:
            try:
                value: FlopCount | None = self._counter(module, args, kwargs, **kw)
            except FlopCountNotReady:
                raise
            except FlopCountError as fake_error:
                # Fake tensors cannot run it (data-dependent ops): count it once on real tensors.
                if self._counter is not count_step_flops or _never_replay(unwrap_module(module)) is not None:
                    raise
                try:
                    value = self._counter(module, args, kwargs, **kw, real=True)
                except FlopCountRefused:
                    raise
                except FlopCountError:
                    raise fake_error from None
        except FlopCountNotReady:
            return None
        except FlopCountError as e:
            # Said when this signature comes again (looked up, not by the last-call fast path): a
            # malformed batch that a loop catches fails the user's forward too, and is no reason.
            self._replayed(t0)
            self.errors += 1
            if len(self._unsaid) < 64:
                self._unsaid[key] = str(e)
            self.misses += 1
            self._entries[key] = None
            return None
        self._replayed(t0)
        self.misses += 1
        self._entries[key] = value
        if shape is not None and isinstance(value, FlopCount):
            self._learn(shape, value)
        if not count_kwargs:
            self._remember(mid, args, kwargs, value)
        return value

    def _replayed(self, t0: int) -> None:
        self.replays += 1
        self.replay_ns += time.perf_counter_ns() - t0

    def _computed_by_law(self, skeleton: tuple[Any, ...], dims: tuple[int, ...]) -> FlopCount | None:
        """The count a checked law computes for these sizes, or None."""
        for law in self._laws.get(skeleton, ()):
            xs = law.size_of(dims)
            if xs is not None and law.covers(xs):
                got = law.predict(xs)
                if got is not None:
                    return got
        return None

    def _learn(self, shape: tuple[tuple[Any, ...], tuple[int, ...]], value: FlopCount) -> None:
        """A replay's count: a point of each law it lies on; on none, with an earlier replay of
        the same skeleton that differs from it in one or two sizes, the first points of a new law
        (with the earlier replays that lie on it too)."""
        skeleton, dims = shape
        seen = self._seen.setdefault(skeleton, [])
        laws = self._laws.setdefault(skeleton, [])
        on_one = False  # on a law, broken ones too: a dropped law stays dropped (no new one in its place)
        for law in laws:
            xs = law.size_of(dims)
            if xs is not None:
                law.add(xs, value)
                on_one = True
        if not on_one and len(laws) < _SEEN:
            for dims0, _ in reversed(seen):
                new = _Law.between(dims0, dims)
                if new is not None:
                    for d, v in [*seen, (dims, value)]:
                        xs = new.size_of(d)
                        if xs is not None:
                            new.add(xs, v)
                    laws.append(new)
                    break
        seen.append((dims, value))
        del seen[:-_SEEN]

    def retrain(self, mid: int) -> None:
        """Module ``mid``'s trainable parameters changed: its next calls are counted again (the
        backward's FLOPs follow them), under a new generation of its keys."""
        self._last.pop(mid, None)
        self._gen[mid] = self._gen.get(mid, 0) + 1

    def forget(self, mid: int) -> None:
        """Module ``mid`` was freed: drop its counts (a new module may get its id) and give back
        the budget they used (``max_misses`` bounds the signatures of the live modules). Any
        thread; the training thread may be adding an entry meanwhile."""
        self._last.pop(mid, None)
        self._gen.pop(mid, None)
        gone = [k for k in list(self._entries) if k and k[0] == mid]
        replayed = len(gone)
        for k in gone:
            self._entries.pop(k, None)
            self._unsaid.pop(k, None)
            if k in self._computed:
                self._computed.discard(k)
                replayed -= 1
        for d in (self._laws, self._seen):
            for k in [k for k in list(d) if k and k[0] == mid]:
                d.pop(k, None)
        self.misses = max(self.misses - replayed, 0)

    def _remember(self, mid: int, args: Any, kwargs: Any, value: FlopCount | None) -> None:
        """Keep this call's signature as the module's last one, when it has the flat shape the
        fast path compares (tensors and small scalars, positional or keyword); else forget it."""
        sig = CallSig.of(args, kwargs, value is None or value.tf32_sensitive)
        if sig is None:
            self._last.pop(mid, None)
        else:
            self._last[mid] = (sig, value)

    def __len__(self) -> int:
        return len(self._entries)


# ----------------------------------------------------------------------------- user overrides


def transformer_flops(
    n_params: int,
    tokens: int,
    *,
    n_layers: int = 0,
    d_model: int = 0,
    seq_len: int = 0,
) -> int:
    """Training FLOPs of a decoder transformer, PaLM appendix B: 6*N*T + 12*L*d*S*T.

    ``n_params`` should be the non-embedding parameters (embedding lookups do no matmul; count a
    separate LM head once, tied or not). The attention term counts the full S x S score matrix
    (causal or not), forward + backward, as ``count_step_flops`` does; pass ``n_layers``,
    ``d_model`` (= heads * head_dim) and ``seq_len`` to include it.
    """
    for name, v in (("n_params", n_params), ("tokens", tokens), ("n_layers", n_layers), ("d_model", d_model), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"transformer_flops: {name} must be an integer >= 0, got {v!r}")
    return 6 * n_params * tokens + 12 * n_layers * d_model * seq_len * tokens


def resolve_override(override: Any, batch: Any, dtype_key: str) -> FlopCount | None:
    """The user's FLOPs for one micro-batch: a number, or a callable of the batch returning one
    (or None for unknown). ``dtype_key`` is the step's matmul dtype (``peaks.matmul_dtype_key``)."""
    if callable(override):
        value = override(batch)
        if value is None:
            return None
        if isinstance(value, FlopCount):
            return value
    else:
        value = override
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"flops must be a number >= 0, or a callable(batch) returning one (or None); got {value!r}"
        )
    return FlopCount.from_total(value, dtype_key)


def alignment_finding(count: FlopCount | None, *, rank: int, step: int | None = None) -> Any:
    """The start-up ``tensor_core_alignment`` finding from a count's lint, or None if all is well."""
    if count is None or not count.alignment:
        return None
    from ..analysis.kinds import make_finding

    names = sorted({a["module"] for a in count.alignment})
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return make_finding(
        "tensor_core_alignment",
        rank=rank,
        step=step,
        summary=f"{len(count.alignment)} matmul(s) not Tensor Core aligned in: {shown}",
        data={"layers": list(count.alignment)},
    )

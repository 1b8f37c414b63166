"""Tokens and samples of a micro-batch, inferred from what the model is called with.

Rules (docs/mfu.md repeats them for users), applied to the outermost module's call
``model(*args, **kwargs)``:

1. ``input_ids`` among the keyword arguments, or a mapping (dict, HF ``BatchEncoding``) as the first
   positional argument holding ``input_ids``: samples = ``input_ids.shape[0]``; tokens = the number
   of ones in ``attention_mask`` when the mapping has one (padding excluded), else
   ``input_ids.numel()`` (or the count of ids != ``pad_token_id`` when one is given). Else, the
   same way, ``inputs_embeds`` ``[batch, seq, hidden]``: samples = dim 0, tokens = the mask's ones
   or batch x seq; else ``pixel_values``, ``input_values`` or ``input_features`` (images, audio):
   samples = dim 0, tokens unknown.
2. Otherwise the first positional argument (or first element of a tuple/list passed first):
   an integer tensor of 2 dims ``[batch, seq]`` is token ids: tokens = the ones of an
   ``attention_mask`` keyword of its shape (``model(ids, attention_mask=mask)``, Hugging Face's
   common call), else numel (minus ``pad_token_id`` entries if given), samples = dim 0. Any
   other tensor (images, features): samples = dim 0, tokens unknown; except a 1-D float tensor
   ``[n]`` when the model's first ``nn.Linear`` (registration order) has ``n`` input features:
   one unbatched sample (an RL policy called with one state; ``ThroughputCollector._unbatched``).
   A *sequence-first* model (every ``nn.RNNBase`` / ``nn.MultiheadAttention`` in it has
   ``batch_first=False``, torch's default, and it has at least one: ``[seq, batch]`` inputs, as
   word_language_model) reads samples from dim 1 instead, unless
   its first such layer, at the model's first call, gets its batch from the input's dim 0 (a
   model that permutes its input itself; ``ThroughputCollector._probe_layout``). A
   ``PackedSequence`` (a tuple, but not one to unpack): samples = its sequences, tokens = its
   data's rows when they are ids. A list of tensors passed with a list of one dict per element
   (torchvision's detection models, ``model(images, targets)``): samples = its length. A list or
   tuple passed first that holds *per-sample tensors* (``_per_sample_tensors``): samples = its
   length; tokens = the elements of all of them (minus ``pad_token_id`` entries) when they are
   1-D integer tensors (variable-length id sequences the model pads itself), else unknown. It
   holds per-sample tensors when it holds at least two tensors, all of one ndim (>= 1), dtype
   and device, whose shapes are not all equal, and either (a) their batch dims (dim 0; dim 1 of
   2-D or wider tensors for a sequence-first model) are not all equal, so they cannot be one
   collated batch, or (b) they are the unbatched input of the model's first convolution
   (registration order; ``ThroughputCollector._conv_input``): floating, of ndim its spatial
   dims + 1, dim 0 its ``in_channels`` (images ``[C, H_i, W_i]`` of different sizes). Anything
   else passed in a list or tuple is a collated batch, read by its first element as above:
   tensors sharing the batch dim (``(x, mask)``, ``[x, lengths]``, two inputs ``[B, d1]``,
   ``[B, d2]``), tensors of different ndim or dtype. Ambiguous, and read as a collated batch:
   per-sample tensors that all have one shape (equal-length sequences, same-sized images), and
   per-sample tensors that share dim 0 with no convolution to say so (``[C, L_i]`` audio into
   a model without a ``Conv1d`` first). A mapping passed first without rule 1's keys: its first
   tensor value, read as above.
3. Anything else: both unknown (None). Never a guess from an unrelated shape.

Counting non-padding tokens needs a reduction over the mask; on a GPU it is queued on the device
with an async copy (like the grad norm) and read by ``resolve`` on the background thread.
"""

from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .flops import CallSig, FlopCache, FlopCount, FlopCountError, count_step_flops, resolve_override
from ..cuda_ext import copy_to_host, event_done
from .peaks import matmul_dtype_key
from ..hooks.install import called_from
from ..hooks.phases import Collector, untracked
from ..hooks.replay import REPLAY

# Signatures whose non-reentrant recompute is counted on fakes (``_early_stop_part``).
_MAX_RECOMPUTE_COUNTS = 64
# Frames above a recompute observer's caller searched for a reentrant checkpoint's backward.
_RECOMPUTE_CALLER_DEPTH = 7


def _reentrant_recompute(frame: Any) -> bool:
    """A reentrant checkpoint's backward (``CheckpointFunction.backward``) runs ``frame`` or one
    of the frames above it: the recompute is the whole forward."""
    import torch.utils.checkpoint as ckpt

    code = getattr(getattr(getattr(ckpt, "CheckpointFunction", None), "backward", None), "__code__", None)
    return code is not None and called_from(code, frame, _RECOMPUTE_CALLER_DEPTH)


def _checkpointed(module: Any) -> Any:
    """``module`` under a non-reentrant checkpoint, as a module to replay (made per replay: it
    holds the module only while counting)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class _Checkpointed(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    return _Checkpointed(module)


# The eval-mode calls of one eval span whose FLOPs and counts wait for the tracker's judgement
# (``_ThroughputMethods._hold``): a search of the step's input gradients (TRADES, 10 iterations
# of two calls) fits; a validation without ``torch.no_grad()`` keeps no more than this.
HELD_CALLS = 64


@dataclass(slots=True)
class BatchCounts:
    """``tokens`` is an int, or a pending device value (``_pending``) until ``resolve``."""

    samples: int | None
    tokens: int | None
    _pending: Any = None
    _host: Any = None
    _event: Any = None
    _device: int = -1

    def resolve(self) -> "BatchCounts | None":
        """Background thread: fill ``tokens`` from the device; None if not ready yet. Reads only a
        host copy whose event completed, or a CPU tensor: never a device sync."""
        if self._pending is None:
            return self
        if self._event is not None:
            if not event_done(self._event, self._device):
                return None
            value = int(self._host.item())
        else:
            t = self._pending
            value = int(t.item() if t.is_cpu else t.to("cpu").item())
        return BatchCounts(self.samples, value)

    def __add__(self, other: "BatchCounts") -> "BatchCounts":
        """Micro-batches of one step add up (both must be resolved); unknown stays unknown."""
        if not isinstance(other, BatchCounts):
            return NotImplemented
        if self._pending is not None or other._pending is not None:
            raise ValueError("resolve() both BatchCounts before adding them")
        s = None if self.samples is None or other.samples is None else self.samples + other.samples
        t = None if self.tokens is None or other.tokens is None else self.tokens + other.tokens
        return BatchCounts(s, t)


def _count_nonzero(mask: Any) -> BatchCounts:
    import torch

    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return BatchCounts(None, None)  # a count queued in a graph capture is the capture's: unknown
    n = (mask != 0).sum()
    if n.device.type == "cuda":
        return BatchCounts(None, None, n, *copy_to_host(n))
    return BatchCounts(None, None, n)


def _from_ids(ids: Any, mask: Any, pad_token_id: int | None) -> BatchCounts:
    samples = int(ids.shape[0]) if ids.dim() >= 2 else None
    if mask is not None and hasattr(mask, "shape") and tuple(mask.shape) == tuple(ids.shape):
        c = _count_nonzero(mask)
    elif pad_token_id is not None:
        c = _count_nonzero(ids != pad_token_id)
    else:
        return BatchCounts(samples, int(ids.numel()))
    c.samples = samples
    return c


def seq_first_layers(module: Any) -> list[Any]:
    """``module``'s RNN and attention layers when it holds some and none of them is
    ``batch_first`` (then it likely takes ``[seq, batch, ...]`` inputs), else ``[]``. Walks the
    module tree: call it once per module."""
    import torch.nn as nn

    from .flops import unwrap_module

    layers = [m for m in unwrap_module(module).modules() if isinstance(m, (nn.RNNBase, nn.MultiheadAttention))]
    return [] if any(getattr(m, "batch_first", False) for m in layers) else layers


def is_seq_first(module: Any) -> bool:
    """True when ``module`` likely takes ``[seq, batch, ...]`` inputs (see :func:`seq_first_layers`)."""
    return bool(seq_first_layers(module))


def _layer_batch(layer: Any, args: Any, kwargs: Any) -> int | None:
    """The batch size a seq-first RNN or attention layer is called with (dim 1 of its batched
    input, a packed sequence's largest batch), None for an unbatched call."""
    import torch
    from torch.nn.utils.rnn import PackedSequence

    x = args[0] if args else kwargs.get("query", kwargs.get("input"))
    if isinstance(x, PackedSequence):
        return int(x.batch_sizes[0])
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return int(x.shape[1])
    return None


# Keyword arguments (or keys of a mapping passed first) other than input_ids that hold a batch in
# dim 0, by Hugging Face's names: token positions (an LM fed embeddings), and inputs whose
# elements are no tokens (images: ViT, ConvNeXt; audio: wav2vec2, Whisper).
_EMBEDS = "inputs_embeds"
_NOT_TOKENS = ("pixel_values", "input_values", "input_features")


def _keyed(inputs: Mapping[str, Any]) -> tuple[Any, Any, str] | None:
    """``(tensor, attention_mask, kind)`` from the first of input_ids (kind ``ids``),
    inputs_embeds (``embeds``) or an image/audio key (``batch``) that holds a tensor; None when
    none does."""
    import torch

    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids, inputs.get("attention_mask"), "ids"
    embeds = inputs.get(_EMBEDS)
    if isinstance(embeds, torch.Tensor):
        return embeds, inputs.get("attention_mask"), "embeds"
    for key in _NOT_TOKENS:
        x = inputs.get(key)
        if isinstance(x, torch.Tensor):
            return x, None, "batch"
    return None


def _per_sample_tensors(first: Any, seq_first: bool = False, conv_input: tuple[int, int] | None = None) -> bool:
    """``first`` (the first positional argument) is a list or tuple of per-sample tensors, one
    sample each (rule 2 of the module docstring): at least two tensors of one ndim (>= 1), dtype
    and device, whose shapes are not all equal, and either whose batch dims (dim 0; dim 1 of a
    seq-first model's 2-D or wider tensors) are not all equal, so that they cannot be one
    collated batch, or which are the unbatched input of the model's first convolution
    (``conv_input``: its ``in_channels`` and the ndim of an unbatched input; floating tensors of
    that ndim whose dim 0 is ``in_channels``: images ``[C, H, W]`` of different sizes)."""
    import torch

    if type(first) not in (list, tuple) or len(first) < 2:
        return False
    t0 = first[0]
    if not isinstance(t0, torch.Tensor) or t0.dim() < 1:
        return False
    nd, dtype, device, shape = t0.dim(), t0.dtype, t0.device, t0.shape
    same_shape = True
    for t in first:
        if not isinstance(t, torch.Tensor) or t.dim() != nd or t.dtype != dtype or t.device != device:
            return False
        same_shape = same_shape and t.shape == shape
    if same_shape:
        return False  # a collated batch, or per-sample tensors of one shape: ambiguous, read as a batch
    bdim = 1 if seq_first and nd >= 2 else 0
    if any(t.shape[bdim] != shape[bdim] for t in first):
        return True
    return (conv_input is not None and nd == conv_input[1] and t0.is_floating_point()
            and int(shape[0]) == conv_input[0])


def _from_per_sample(tensors: Any, pad_token_id: int | None) -> BatchCounts:
    """Per-sample tensors (:func:`_per_sample_tensors`): one sample each; 1-D integer tensors
    are token ids (their elements, less ``pad_token_id`` ones when given)."""
    import torch

    t0 = tensors[0]
    n = len(tensors)
    if t0.dim() != 1 or t0.is_floating_point() or t0.is_complex() or t0.dtype == torch.bool:
        return BatchCounts(n, None)
    if pad_token_id is None:
        return BatchCounts(n, sum(int(t.numel()) for t in tensors))
    c = _count_nonzero(torch.cat(tuple(tensors)) != pad_token_id)
    c.samples = n
    return c


def _conv_input(module: Any) -> tuple[int, int] | None:
    """``(in_channels, ndim of an unbatched input)`` of ``module``'s first convolution in
    registration order (``Conv2d(3, ...)``: ``(3, 3)``, images ``[C, H, W]``), None without
    one. Walks the module tree: once per model."""
    import torch.nn as nn

    from .flops import unwrap_module

    try:
        for m in unwrap_module(module).modules():
            if isinstance(m, nn.modules.conv._ConvNd):
                return int(m.in_channels), len(m.kernel_size) + 1
    except Exception:  # noqa: BLE001 - a module tree that cannot be walked: no convolution known
        pass
    return None


def _rule_input(args: Any, kwargs: Mapping[str, Any] | None, seq_first: bool = False,
                conv_input: tuple[int, int] | None = None) -> tuple[Any, Any, str]:
    """What the rules read from a call: ``(tensor, attention_mask, kind)`` from a known keyword
    (rule 1: kind ``ids``, ``embeds`` or ``batch``, see :func:`_keyed`), ``(the list, None,
    "samples")`` for a list or tuple of per-sample tensors passed first
    (:func:`_per_sample_tensors`), else ``(the positional tensor or None, the attention_mask
    keyword or None, "")`` (rule 2: ``model(ids, attention_mask=mask)``, Hugging Face's common
    call, whose ids are counted as rule 1 counts them)."""
    import torch

    mask = None
    if kwargs:
        keyed = _keyed(kwargs)
        if keyed is not None:
            return keyed
        mask = kwargs.get("attention_mask")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    first = args[0] if args else None
    if isinstance(first, (tuple, list)) and first and not _is_packed(first):
        if _per_sample_tensors(first, seq_first, conv_input):
            return first, None, "samples"
        first = first[0]
    if _is_packed(first):
        return first, None, ""
    if isinstance(first, Mapping):
        keyed = _keyed(first)
        if keyed is not None:
            return keyed
        first = next((v for v in first.values() if isinstance(v, torch.Tensor)), None)
    return (first if isinstance(first, torch.Tensor) else None), mask, ""


def _from_embeds(embeds: Any, mask: Any) -> BatchCounts:
    """``inputs_embeds`` ``[batch, seq, hidden]``: samples = dim 0; tokens = the mask's ones when
    a mask ``[batch, seq]`` comes with it, else batch x seq. Unbatched: both unknown."""
    if embeds.dim() < 3:
        return BatchCounts(None, None)
    samples = int(embeds.shape[0])
    if mask is not None and hasattr(mask, "shape") and tuple(mask.shape) == tuple(embeds.shape[:2]):
        c = _count_nonzero(mask)
        c.samples = samples
        return c
    return BatchCounts(samples, samples * int(embeds.shape[1]))


def _per_sample_list(args: Any, kwargs: Mapping[str, Any] | None) -> int | None:
    """torchvision's detection models' call, ``model(images, targets)``: ``images`` a list of
    per-sample ``[C, H, W]`` tensors (their sizes may differ, so they are not one batch) and
    ``targets`` (second positional or keyword) a list of one dict per image. The samples are the
    images; the rule for a list passed first (its first element's dim 0) read the channels. None
    for any other call."""
    import torch

    if not isinstance(args, (tuple, list)) or not args:
        return None
    first = args[0]
    if type(first) not in (list, tuple) or not first:
        return None
    targets = args[1] if len(args) > 1 else (kwargs or {}).get("targets")
    if not isinstance(targets, (list, tuple)) or len(targets) != len(first):
        return None
    if not all(isinstance(t, Mapping) for t in targets) or not all(isinstance(x, torch.Tensor) for x in first):
        return None
    return len(first)


def _is_packed(x: Any) -> bool:
    """A ``torch.nn.utils.rnn.PackedSequence`` (a tuple: never read as "a tuple passed first")."""
    return type(x).__name__ == "PackedSequence" and hasattr(x, "batch_sizes")


def _from_packed(x: Any) -> BatchCounts:
    """A packed batch: its sequences are the samples (the first time step's batch size); its
    data's rows, one per element of every sequence, are the tokens when they are token ids (a
    packed batch holds no padding)."""
    data = x.data
    samples = int(x.batch_sizes[0]) if x.batch_sizes.numel() else 0
    ids = data.dim() == 1 and not data.is_floating_point() and not data.is_complex()
    return BatchCounts(samples, int(data.shape[0]) if ids else None)


def infer_batch_counts(
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    pad_token_id: int | None = None,
    seq_first: bool = False,
    conv_input: tuple[int, int] | None = None,
) -> BatchCounts:
    """Samples and tokens of one call ``model(*args, **kwargs)`` (training thread, no sync).
    ``seq_first``: a positional input is ``[seq, batch, ...]`` (see :func:`is_seq_first`).
    ``conv_input``: the model's first convolution's ``in_channels`` and the ndim of its unbatched
    input (see :func:`_conv_input`), which tells a list of per-sample images passed first."""
    import torch

    per_sample = _per_sample_list(args, kwargs)
    if per_sample is not None:
        return BatchCounts(per_sample, None)
    first, mask, kind = _rule_input(args, kwargs, seq_first, conv_input)
    if kind == "samples":
        return _from_per_sample(first, pad_token_id)
    if kind == "ids":
        return _from_ids(first, mask, pad_token_id)
    if kind == "embeds":
        return _from_embeds(first, mask)
    if kind == "batch":
        return BatchCounts(int(first.shape[0]) if first.dim() >= 1 else None, None)
    if _is_packed(first):
        return _from_packed(first)
    if first is not None and first.dim() >= 1:
        batch_dim = 1 if seq_first and first.dim() >= 2 else 0
        samples = int(first.shape[batch_dim])
        if first.dim() == 2 and not first.is_floating_point() and not first.is_complex() and first.dtype != torch.bool:
            c = _from_ids(first, mask, pad_token_id)  # a mask of another shape is not this one's: numel
            c.samples = samples
            return c
        return BatchCounts(samples, None)
    return BatchCounts(None, None)


# ----------------------------------------------------------------------------- step collector


class _EvalMode:
    """The batch counts of a model call in eval mode that was the step's own work (see
    ``StepThroughput.counts``)."""

    __slots__ = ("counts",)

    def __init__(self, counts: BatchCounts) -> None:
        self.counts = counts


class StepThroughput:
    """What one step's root forwards left for the background thread: per forward, its FLOPs
    (None: unknown) and, for the model's calls, the micro-batch's token/sample counts. Summed
    here, off the training thread (adding FlopCounts costs microseconds a forward)."""

    __slots__ = ("items", "_flops")

    def __init__(self, items: list[tuple[Any, "BatchCounts | None"]]) -> None:
        self.items = items
        self._flops: Any = _UNSET

    @property
    def micro_batches(self) -> int:
        return len(self.counts)

    @property
    def counts(self) -> list[BatchCounts]:
        """The batch counts of the model's calls in train mode; where it made none (a model
        trained in eval mode), of its eval-mode calls that were the step's work (``_EvalMode``).
        Beside train-mode calls, those are a search on the step's batch (an adversarial one's
        input gradients, TRADES): no samples of their own."""
        train = [c for _, c in self.items if c is not None and type(c) is not _EvalMode]
        if train:
            return train
        return [c.counts for _, c in self.items if type(c) is _EvalMode]

    @property
    def flops(self) -> Any:
        """FLOPs summed over the step's forwards (FlopCount), None if any was unknown."""
        if self._flops is _UNSET:
            total = None
            for fc, _ in self.items:
                if fc is None:
                    total = None
                    break
                if total is None:
                    total = fc
                elif not fc.empty:  # a loss module's count is often empty
                    total = total + fc
            self._flops = total
        return self._flops

    def resolve(self) -> "tuple[Any, int | None, int | None] | None":
        """(FlopCount | None, tokens, samples), or None while a token count is on the device."""
        counts = self.counts
        total = BatchCounts(0, 0)
        for c in counts:
            r = c.resolve()
            if r is None:
                return None
            total = total + r
        if not counts:
            return self.flops, None, None
        return self.flops, total.tokens, total.samples


_UNSET = object()
_RECOUNT = object()  # a model call whose counts depend on values (a mask, a pad id): counted each call
_ANY_CALL = object()  # a root whose count holds for any call (see ThroughputCollector._remember)
# torch's losses are elementwise ops and reductions, which FlopCounterMode does not count, except
# this one, whose distance function is the user's (it may hold a matmul).
_LOSSES_MODULE = "torch.nn.modules.loss"
_USER_DISTANCE_LOSSES = frozenset({"TripletMarginWithDistanceLoss"})


def _counts_nothing(module: Any, fc: Any) -> bool:
    """``fc`` (the module's count for one call) is empty, and would be for any call: ``module``
    is one of torch's own loss classes (not a subclass of one, which may do anything)."""
    t = type(module)
    return fc.empty and t.__module__ == _LOSSES_MODULE and t.__name__ not in _USER_DISTANCE_LOSSES


def _trainable(module: Any) -> tuple[bool, ...]:
    """Which of ``module``'s parameters require grad."""
    return tuple(p.requires_grad for p in module.parameters())


class _PyThroughputCore:
    """The collector's hot path (one root forward like the module's last call) in Python: the
    reference that metrics/_cmetrics.c's ``ThroughputCore`` translates line for line, and the
    one used where that extension was not built. Its state is ``ThroughputCollector``'s."""

    __slots__ = ("_grad_enabled", "_replay", "_hits", "_items", "_any_call", "_recount", "_followers", "_appended")

    def on_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        self._appended = False
        if not self._grad_enabled() or (self._replay.active and self._replay.mine()):
            return
        if getattr(module, "training", True) is False:  # eval mode: evaluation or not, said later
            self._on_forward_full(module, args, kwargs)  # type: ignore[attr-defined]
            return
        hit = self._hits.get(id(module))
        if hit is not None and not (hit[0] is self._any_call or hit[0].matches(args, kwargs)):
            hit = hit[2]  # the signature before the last (two in turn: micro-batch lengths)
            if hit is not None and not hit[0].matches(args, kwargs):
                hit = None
        if hit is not None:
            item = hit[1]
            if (item[1] is None and hit[0] is not self._any_call and not self._items
                    and id(module) not in self._followers):  # one without parameters never does
                self._on_forward_full(module, args, kwargs)  # another root opens the step: the step's model now
                return
            if item[1] is self._recount:
                item = (item[0], self._batch_counts(args, kwargs))
            self._items.append(item)
            self._appended = True
            return
        self._on_forward_full(module, args, kwargs)  # type: ignore[attr-defined]

    def take(self) -> StepThroughput | None:
        items = self._items
        if not items:
            return None
        self._items = []
        # Numbers and cached counts only: nothing in it can refer back to it (hooks/_ctracker.c).
        return untracked(StepThroughput(untracked(items)))


try:  # the hot path in C (metrics/_cmetrics.c): the same items, less time a forward
    from ._cmetrics import ThroughputCore as _ThroughputCore, _bind_take

    _bind_take(StepThroughput, _UNSET)  # the class its take() builds
except ImportError:  # not built here (no compiler): the Python above
    _ThroughputCore = _PyThroughputCore


class _ThroughputMethods(Collector):
    """FLOPs and tokens per micro-batch, summed per step (``extras["throughput"]``).

    Training thread: ``on_forward(module, args, kwargs)`` for each root module's call (model,
    loss module...), before its forward. FLOPs: the user's ``flops`` override (a number, or a
    callable of the batch) or ``FlopCache`` (counted once per input signature). Tokens and
    samples come from the first root that runs with grad enabled (the model, called before its
    loss module), unless it has no parameters (a tokenizer module) and a root that has some is
    called in the step (``_first_call``). Eval forwards (grad disabled) and replays
    (``hooks.replay``) are ignored.

    The hot path (``on_forward``: metrics/_cmetrics.c's, or ``_PyThroughputCore``'s where that
    was not built) is one lookup: a module called as last time (same argument shapes, dtypes and
    devices, the same autocast and TF32 state) appends what that call left, ``(FlopCount,
    BatchCounts)``, to the step's list; everything else (first calls, new shapes, overrides,
    counts that depend on values) takes the full path. ``exclude(ns)`` gets the time of a FLOP
    count (a cache miss: stepwatch's own one-off work, kept out of the step).
    """

    name = "throughput"
    # Steps between two looks at which parameters of each root train (``recheck``).
    RECHECK_EVERY = 64

    def __init__(
        self,
        *,
        flops: Any = None,
        cache: Any = None,
        pad_token_id: int | None = None,
        max_misses: int = 32,
        exclude: Callable[[int], None] | None = None,
        watch_trainable: Callable[[], None] | None = None,
    ) -> None:
        if flops is not None and not callable(flops):
            if isinstance(flops, bool) or not isinstance(flops, (int, float)) or flops < 0:
                raise ValueError(f"flops must be a number >= 0 or a callable(batch), got {flops!r}")
        self.override = flops
        self.cache = cache if cache is not None else FlopCache(max_misses=max_misses)
        self.pad_token_id = pad_token_id
        self.exclude = exclude
        self._token_root: int | None = None
        self._seq_first = False
        self._layout_layers: list[Any] | None = None  # a new model's seq-first layers, until its first call is probed
        self._conv_input: tuple[int, int] | None = None  # the model's first convolution (_conv_input)
        self._layouts: dict[int, tuple[bool, list[Any] | None, Any]] = {}  # the same three, per model not in use now
        self._known: set[int] = set()  # ids of the live roots this collector has seen called
        # Ids of the live roots without parameters (a tokenizer or transform module, a loss
        # module): they take the model's role only from one of their own (_first_call).
        self._followers: set[int] = set()
        self._opened: list[Any] | None = None  # the step's items when the model took its role
        # Per root (by id): a weak reference and which of its parameters required grad (recheck).
        self._roots: dict[int, tuple[Any, tuple[bool, ...]]] = {}
        # Each root's finalizer (_forget when the module dies), detached at the session's stop:
        # weakref.finalize keeps its callback, and so this collector and the whole session, for as
        # long as the module lives (a notebook's model outlived every session that timed it).
        self._finalizers: list[Any] = []
        # Called once, when a root with frozen parameters is first seen: its caller makes
        # ``recheck`` a step-end listener (a job whose roots all train pays nothing a step).
        self._watch_trainable = watch_trainable
        # The first FLOPs count (for the start-up Tensor Core lint: flops.alignment_finding).
        self.first_count: Any = None
        self._dtype_keys: dict[int, str] = {}
        # Per root module (by id), when its last call had a flat signature: that signature and
        # what the call appended.
        # (CallSig or _ANY_CALL, what it appended, the same for the signature before or None)
        self._hits: dict[int, tuple[Any, tuple[Any, Any], Any]] = {}
        self._items: list[tuple[Any, BatchCounts | None]] = []
        self._appended = False  # the last on_forward appended (on_exception takes it back)
        self._again: tuple[list[Any], int] | None = None  # (the step's items, where a re-evaluation began)
        self._held: tuple[Any, list[Any] | None] | None = None  # (the step's items, an eval span's eval-mode calls)
        self._recomputes: dict[tuple[Any, ...], Any] = {}  # a non-reentrant recompute's FLOPs, per signature
        import torch

        self._grad_enabled = torch.is_grad_enabled
        self._replay = REPLAY
        self._any_call = _ANY_CALL
        self._recount = _RECOUNT

    def _on_forward_full(self, module: Any, args: Any, kwargs: Any) -> None:
        mid = id(module)
        if mid not in self._known:
            self._first_call(module, mid, args, kwargs)
        elif (mid != self._token_root and not self._items and getattr(module, "training", True) is not False
              and mid not in self._followers):
            self._take_over(module, mid)
        is_model = mid == self._token_root
        if self.override is not None:
            if not is_model:
                return  # the user's number is the whole micro-batch
            batch = args[0] if len(args) == 1 and not kwargs else (kwargs or args)
            fc = resolve_override(self.override, batch, self._dtype_key(module))
        else:
            fc = self._count(module, args, kwargs)
        if fc is not None and self.first_count is None:
            self.first_count = fc
        counts = self._batch_counts(args, kwargs) if is_model else None
        if counts is not None and self._layout_layers and self._probe_layout(module, self._layout_layers, args,
                                                                             kwargs, counts):
            self._layout_layers = None
        elif counts is not None and counts.samples is not None and counts.tokens is None:
            self._unbatched(module, args, kwargs, counts)
        self._remember(module, args, kwargs, fc, counts)
        if getattr(module, "training", True) is False:
            self._hold((fc, counts), mid)
            return
        self._items.append((fc, counts))
        self._appended = True

    def _count(self, module: Any, args: Any, kwargs: Any) -> Any:
        """The call's FlopCount from the cache; a replay (a miss) is stepwatch's own time, kept
        out of the step."""
        cache = self.cache
        misses = cache.misses
        t0 = time.perf_counter_ns()
        fc = cache.get(module, args, kwargs)
        if cache.misses != misses and self.exclude is not None:
            self.exclude(time.perf_counter_ns() - t0)
        return fc

    def on_recompute(self, module: Any, args: Any, kwargs: Any) -> None:
        """Training thread: a root called inside a backward, the recompute of a root checkpointed
        from the loop (``checkpoint(model, x)``). Its forward runs again on the device: hardware
        work (``hfu``), not the model's FLOPs, and no samples. A reentrant checkpoint runs the
        whole forward again; a non-reentrant one stops once the last tensor it must save again is
        made: that part is counted once per signature, on fakes, under the same checkpoint."""
        self._appended = False
        if self.override is not None or (self._replay.active and self._replay.mine()):
            return
        fc = self._count(module, args, kwargs)
        if fc is None or not fc.forward:
            return
        again = fc.forward
        if not _reentrant_recompute(sys._getframe(1)):
            part = self._early_stop_part(module, args, kwargs)
            if part is not None:
                again = part
        self._items.append((FlopCount(recompute=dict(again), tf32_sensitive=fc.tf32_sensitive), None))

    def _early_stop_part(self, module: Any, args: Any, kwargs: Any) -> "Mapping[str, int] | None":
        """What a non-reentrant checkpoint of ``module`` recomputes for this call, by dtype: a
        replay of ``checkpoint(module, ...)`` on fakes, once per signature (at most
        ``_MAX_RECOMPUTE_COUNTS``; None past them, or when it fails: the whole forward then)."""
        key = self.cache.key(module, args, kwargs)
        got = self._recomputes.get(key, _UNSET)
        if got is not _UNSET:
            return got
        if len(self._recomputes) >= _MAX_RECOMPUTE_COUNTS:
            return None
        t0 = time.perf_counter_ns()
        try:
            got = dict(count_step_flops(_checkpointed(module), args, kwargs).recompute)
        except FlopCountError:
            got = None
        if self.exclude is not None:
            self.exclude(time.perf_counter_ns() - t0)
        self._recomputes[key] = got
        return got

    def on_exception(self, phase: str, exc: BaseException) -> None:
        """Training thread: a hooked call raised. A root call's observers ran before it, so what
        the last ``on_forward`` appended is that call's (only the outermost call is observed):
        a model call that raised on a malformed batch the loop skips processed no samples and
        its FLOPs are no count. Taken back; a grad-disabled call (``eval``) appended nothing."""
        if phase == "forward" and self._appended and self._items:
            self._items.pop()
        self._appended = False

    def _hold(self, item: tuple[Any, BatchCounts | None], mid: int) -> None:
        """A call of a root in eval mode with grad enabled opens an eval span (hooks/phases.py):
        a validation loop without ``torch.no_grad()``, or the step's own forward (a model trained
        in eval mode). Its item waits for the tracker's judgement (``on_eval_span``); past
        ``HELD_CALLS`` calls (a span with backwards in it may still be the step's: a search of
        the step's input gradients) its calls are not kept, whatever follows."""
        held = self._held
        if held is None or held[0] is not self._items:
            held = self._held = (self._items, [])
        kept = held[1]
        if kept is None:
            return
        if len(kept) < HELD_CALLS:
            kept.append((item, mid))
        else:
            self._held = (held[0], None)  # evaluation: nothing of this span is kept

    def on_eval_span(self, evaluation: bool) -> None:
        """Training thread, when the tracker closes an eval span: evaluation drops what the span's
        eval-mode calls left; the step's own work adds it to the step, its samples and tokens only
        from calls of the root that is the model now. A frozen teacher in eval mode called before
        the student was the model at the run's first call, until the student's call took over:
        step 0 counted the teacher's calls as samples too (three times the batch with two)."""
        held, self._held = self._held, None
        if held is not None and held[1] and not evaluation and held[0] is self._items:
            token = self._token_root
            self._items.extend((item[0], _EvalMode(item[1]) if mid == token and item[1] is not None else None)
                               for item, mid in held[1])

    def on_reevaluation(self, begins: bool) -> None:
        """Training thread: an optimizer's closure evaluated again within one step (LBFGS) runs the
        step's batch again. Its forwards keep their FLOPs (the device ran them) and count no
        samples or tokens: the step's batch was counted at its first evaluation."""
        if begins:
            self._again = (self._items, len(self._items))
            return
        again, self._again = self._again, None
        if again is None or again[0] is not self._items:  # the step ended in between: nothing of it here
            return
        items, start = again
        for i in range(start, len(items)):
            fc, counts = items[i]
            if counts is not None:
                items[i] = (fc, None)

    def _first_call(self, module: Any, mid: int, args: Any = (), kwargs: Any = None) -> None:
        """A root's first call. The model (whose calls give the step's samples and tokens) is the
        first root called in a step; a root never called before that opens a step is a new model
        (the next fold, a model loaded from a checkpoint, the next in a sweep) and takes over from
        the last one. Within a step that holds calls already, a root takes over when:

        - it wraps the model (``_wraps_model``);
        - it has parameters and the model has none (a *follower*: a tokenizer or transform
          module called before the model, as torchtext's and torchvision's transforms are). The
          follower's calls in the step count no samples (their FLOPs stay, as a loss module's). A
          follower takes the role only when there is no model or the model is a follower too: a
          model with nothing to train in it (its input trains) stays the model while it is the
          only root. A frozen module has parameters: a frozen encoder called before a trained
          head stays the model (its input is the batch: the head's are features);
        - it has a parameter that trains and is called in training mode in a step whose calls
          were opened by a model that was the model in an earlier step already: that model's
          micro-batch that no optimizer step took (a sweep's trial, or a run before a resume, that
          ended within an accumulation), which is no part of the new model's step. Its calls are
          dropped, FLOPs with samples, so that the two agree. A second model first called in the
          step that the first one opened (a GAN's other network, co-teaching's second network)
          leaves the role where it is; so does one whose input was computed in this step (a tensor
          with autograd history: a head switched on mid-run, fed the model's output), which
          continues the model's micro-batch: it dropped the model's FLOPs from that step.

        Which roots are followers is decided here, once per root. When a root is freed, what was
        kept under its id goes with it: a new module may get the same id."""
        self._known.add(mid)
        try:
            trainable: tuple[bool, ...] | None = _trainable(module)
        except Exception:  # noqa: BLE001 - parameters() that fails: a model that trains, never rechecked
            trainable = None
        follower = trainable == ()
        trains = trainable is None or any(trainable)
        if follower:
            self._followers.add(mid)
        try:
            fin = weakref.finalize(module, self._forget, mid)
            fin.atexit = False
            self._finalizers.append(fin)
            if trainable is not None:
                self._roots[mid] = (weakref.ref(module), trainable)
                if self._watch_trainable is not None and not all(trainable):
                    watch, self._watch_trainable = self._watch_trainable, None
                    watch()
        except TypeError:  # not weak-referenceable: its id is kept, as before
            pass
        token = self._token_root
        if not self._items:
            if not follower or token is None or token in self._followers:
                self._take_over(module, mid)
            return
        if self._wraps_model(module):
            self._take_over(module, mid)
            return
        if follower:
            if token is None:
                self._take_over(module, mid)
            return
        if token is not None and token in self._followers:
            self._uncount()
        elif (trains and getattr(module, "training", True) is not False and self._opened is not self._items
              and not _computed_in_a_graph(args, kwargs)):
            self._items = []  # the last model's unstepped micro-batch
        elif token is not None:
            return
        self._take_over(module, mid)

    def _uncount(self) -> None:
        """The step's calls so far count no samples or tokens (a follower's, whose role a model
        takes): their FLOPs stay."""
        items = self._items
        for i, item in enumerate(items):
            if item[1] is not None:
                items[i] = (item[0], None)

    def _wraps_model(self, module: Any) -> bool:
        """``module`` holds the model as a submodule: a wrapper made after the optimizer (nanoGPT's
        ``DDP(model)`` after ``configure_optimizers``, whose scan found the inner model) and
        first called within a step that the inner model opened. Its calls are the model's now
        (the inner one's are no root calls any more), so it takes over mid-step."""
        kept = self._roots.get(self._token_root) if self._token_root is not None else None
        model = kept[0]() if kept is not None else None
        if model is None or model is module:
            return False
        try:
            return any(m is model for m in module.modules())
        except Exception:  # noqa: BLE001 - a module whose tree cannot be walked: no take-over
            return False

    def _take_over(self, module: Any, mid: int) -> None:
        """``module`` opens a step: it is the model, whose calls give the step's samples and
        tokens, until another root opens one (a new model, or the other of two models trained in
        turn: an actor and a critic, each stepping after its own forward). The last model's hit is
        dropped: its calls count no samples now, and its next call that opens a step takes the
        full path and takes over again. So are the new model's hits (remembered while it was a
        follower, they count no samples). What a model's first call learnt of its layout stays
        with it (``_layouts``)."""
        old = self._token_root
        if old is not None:
            self._hits.pop(old, None)
            self._layouts[old] = (self._seq_first, self._layout_layers, self._conv_input)
        self._hits.pop(mid, None)  # what it appended before, as a follower, counted no samples
        self._token_root = mid
        self._opened = self._items
        kept = self._layouts.pop(mid, None)
        if kept is None:
            self._layout_layers = seq_first_layers(module)
            self._seq_first = bool(self._layout_layers)
            self._conv_input = _conv_input(module)
        else:
            self._seq_first, self._layout_layers, self._conv_input = kept

    def _probe_layout(self, root: Any, layers: list[Any], args: Any, kwargs: Any, counts: BatchCounts) -> bool:
        """The first call of a model whose RNN and attention layers are all seq-first: its input is
        ``[seq, batch]`` (word_language_model) or ``[batch, seq]`` that it turns round itself (a
        hand-written encoder). The first such layer's input, within this call, says which, and
        ``counts`` (this call's) is corrected (:func:`_first_layer_in_call`). False when this call
        cannot tell (a square ``[n, n]`` input): the model's next new input shape is looked at
        instead."""
        x, _, keyed = _rule_input(args, kwargs, self._seq_first, self._conv_input)
        if keyed or not isinstance(x, _tensor_type()) or x.dim() < 2 or counts.samples is None:
            return True  # nothing to learn from such calls
        if _compiled(root):
            return True  # a hook inside its call would break its graph: the guess (dim 1) stands
        if x.shape[0] == x.shape[1]:
            return False
        outer = (int(x.shape[0]), int(x.shape[1]))
        wanted = {id(m) for m in layers}
        rid = id(root)

        def found(module: Any, a: Any) -> None:
            batch = _layer_batch(module, a, {})
            if batch is not None and batch in outer and self._token_root == rid:
                self._seq_first = batch == outer[1]
                counts.samples = batch

        _first_layer_in_call(root, lambda m: id(m) in wanted, found)
        return True

    def _unbatched(self, root: Any, args: Any, kwargs: Any, counts: BatchCounts) -> None:
        """A 1-D float input passed first ``[n]``: a batch of n scalars that the model reshapes
        itself, or one unbatched sample of n features (an RL policy called with one state,
        pytorch/examples' actor_critic). The model's first ``nn.Linear`` (in registration order)
        says which: one of ``in_features == n`` takes the vector whole, so ``counts`` (this
        call's, which later calls of the same shape reuse) is one sample. Read from the module
        tree, not from the call (a hook inside a compiled model's call would break its graph)."""
        import torch.nn as nn

        from .flops import unwrap_module

        x, _, kind = _rule_input(args, kwargs, self._seq_first, self._conv_input)
        if kind or not isinstance(x, _tensor_type()) or x.dim() != 1 or not x.is_floating_point():
            return
        first = next((m for m in unwrap_module(root).modules() if isinstance(m, nn.Linear)), None)
        if first is not None and first.in_features == x.shape[0]:
            counts.samples = 1

    def detach(self) -> None:
        """The session stops: its roots' finalizers let go of it (:attr:`_finalizers`)."""
        fins, self._finalizers = self._finalizers, []
        for fin in fins:
            fin.detach()

    def _forget(self, mid: int) -> None:
        """A root was freed (any thread, from its finalizer): drop what is kept under its id."""
        try:
            self._known.discard(mid)
            self._followers.discard(mid)
            self._roots.pop(mid, None)
            self._hits.pop(mid, None)
            self._dtype_keys.pop(mid, None)
            self._layouts.pop(mid, None)
            if self._token_root == mid:
                self._token_root = None
            forget = getattr(self.cache, "forget", None)
            if forget is not None:
                forget(mid)
        except Exception:  # noqa: BLE001 - a finalizer must not raise (it would print at a random point)
            pass

    def recheck(self, step: int) -> None:
        """Training thread, at the end of each step once a root with frozen parameters was seen:
        every ``RECHECK_EVERY`` steps, the roots whose trainable parameters changed (progressive
        unfreezing: ``requires_grad_``, which no input signature shows) are counted again at
        their next call. Their backward's FLOPs stayed the frozen model's for good."""
        if step % self.RECHECK_EVERY:
            return
        for mid, (ref, before) in list(self._roots.items()):
            m = ref()
            if m is None:
                continue
            now = _trainable(m)
            if now != before:
                self._roots[mid] = (ref, now)
                self._hits.pop(mid, None)
                retrain = getattr(self.cache, "retrain", None)
                if retrain is not None:
                    retrain(mid)

    def _remember(self, module: Any, args: Any, kwargs: Any, fc: Any, counts: "BatchCounts | None") -> None:
        """The next call like this one takes the hot path: a known count (the cache's, or a fixed
        override's) with counts that follow from the shapes alone, else counted again each call.
        Not for a count that is None (not ready yet, or over the cache's budget: asked again)
        nor a callable override (it reads the batch). A loss module of torch's own (CrossEntropyLoss,
        MSELoss...) counts no FLOPs whatever its inputs: every later call takes this one's result
        without comparing signatures."""
        if fc is None or callable(self.override):
            sig: Any = None
        elif counts is None and _counts_nothing(module, fc):
            sig = _ANY_CALL
        else:
            sig = CallSig.of(args, kwargs, fc.tf32_sensitive)
        mid = id(module)
        if sig is None:
            self._hits.pop(mid, None)
            return
        if counts is not None and (counts._pending is not None or self.pad_token_id is not None or kwargs
                                   or not args or type(args[0]) is not _tensor_type()):
            counts = _RECOUNT
        # The last signature but one stays as the hit's third part, so two in turn (two
        # micro-batch lengths, a shared encoder on queries and on documents) both take the hot
        # path; a third in the cycle misses each time, as before.
        old = self._hits.get(mid)
        if old is None or old[0] is _ANY_CALL or sig is _ANY_CALL:
            before = None
        elif old[0].matches(args, kwargs):  # the same one again (the full path ran for a hit): keep the other
            before = old[2]
        else:
            before = (old[0], old[1], None)
        self._hits[mid] = (sig, (fc, counts), before)

    def _dtype_key(self, module: Any) -> str:
        import torch

        for dev in ("cuda", "cpu"):
            if torch.is_autocast_enabled(dev):
                return matmul_dtype_key(None, torch.get_autocast_dtype(dev))
        key = self._dtype_keys.get(id(module))
        if key is None:
            p = next(module.parameters(), None)
            dtype = p.dtype if p is not None else torch.float32
            cuda = p is not None and p.device.type == "cuda"
            try:
                key = matmul_dtype_key(dtype, None, cuda and torch.backends.cuda.matmul.allow_tf32)
            except ValueError:
                key = "fp32"
            self._dtype_keys[id(module)] = key
        return key

    def _batch_counts(self, args: Any, kwargs: Any) -> BatchCounts:
        return infer_batch_counts(args, kwargs, pad_token_id=self.pad_token_id, seq_first=self._seq_first,
                                  conv_input=self._conv_input)

class ThroughputCollector(_ThroughputMethods, _ThroughputCore):  # type: ignore[misc,valid-type]
    __doc__ = _ThroughputMethods.__doc__  # its hot path: C where metrics/_cmetrics.c was built
    take = _ThroughputCore.take  # the core's, not Collector's (before it in the MRO)


class PyThroughputCollector(_ThroughputMethods, _PyThroughputCore):
    """``ThroughputCollector`` with the Python hot path always (tests compare the two)."""

    take = _PyThroughputCore.take


def _compiled(root: Any) -> bool:
    """``root`` or a module in it runs through ``torch.compile`` (``torch.compile(model)``, or
    ``model.compile()``: a ``_compiled_call_impl`` that is not stepwatch's root call around the
    module's own ``_call_impl``). Walks the module tree: for one-off probes only."""
    for m in root.modules():
        if type(m).__name__ == "OptimizedModule":
            return True
        impl = m.__dict__.get("_compiled_call_impl")
        # stepwatch's root call holds the module's own _call_impl unbound (``bound``)
        if impl is not None and getattr(impl, "bound", None) is not True and getattr(impl, "inner", impl) != m._call_impl:
            return True
    return False


def _first_layer_in_call(root: Any, is_layer: Callable[[Any], bool], found: Callable[[Any, Any], None]) -> None:
    """Within ``root``'s call that is about to run, hand the first submodule call for which
    ``is_layer(module)`` holds, with its positional arguments, to ``found`` (once). Global module
    hooks, for this one call only (removed at that layer, or when ``root``'s call ends, raised or
    not): a hook on the model would go into a whole-model ``torch.save``. Never for a compiled
    model (:func:`_compiled`): dynamo traces global hooks, and their removal breaks its graph.
    ``found`` runs inside the user's forward, where it must never raise: its errors are
    swallowed."""
    from torch.nn.modules import module as torch_module

    rid = id(root)
    handles: list[Any] = []

    def done() -> None:
        while handles:
            handles.pop().remove()

    def pre(module: Any, a: Any) -> None:
        try:
            if not is_layer(module):
                return
            done()
            found(module, a)
        except Exception:  # noqa: BLE001 - inside the user's forward: never raise there
            pass

    def post(module: Any, a: Any, out: Any) -> None:
        if id(module) == rid:
            done()  # no such layer ran in this call: the guess stands

    handles.append(torch_module.register_module_forward_pre_hook(pre))
    handles.append(torch_module.register_module_forward_hook(post, always_call=True))


def _tensor_type() -> Any:
    import torch

    return torch.Tensor


def _computed_in_a_graph(args: Any, kwargs: Any) -> bool:
    """A tensor argument (or one in a list, tuple or dict argument) carries autograd history: it
    was computed in this step, not fetched as a batch."""
    def history(v: Any) -> bool:
        return getattr(v, "grad_fn", None) is not None

    for v in (*args, *(kwargs.values() if kwargs else ())):
        if history(v):
            return True
        if type(v) in (list, tuple) and any(history(x) for x in v):
            return True
        if type(v) is dict and any(history(x) for x in v.values()):
            return True
    return False

"""What a GPU kernel is, from its name: HTA's three types, and stepwatch's finer classes.

HTA's types (HolisticTraceAnalysis 0.5.0, ``hta/utils/utils.py``) decide the temporal breakdown
and the comm/compute overlap, so they are copied exactly, regular expressions included:
communication ``^nccl.*Kernel`` (RCCL's kernels carry NCCL's names), memory
``^Memcpy|^Memset|^dma``, computation anything not matching
``(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)``, and "other" the rest (e.g. ``Stream Sync``).

The classes (count and share of time in the report) add what a reader wants to know first: is
the time in GEMMs, attention, or the small elementwise/reduction kernels that fusion removes.
CUDA and HIP names: cuBLAS/cuBLASLt/CUTLASS (``gemm``, ``sm80_xmma``, ``cutlass``; cuBLAS 13's
``nvjet_sm90_...`` GEMMs, seen on an H200), rocBLAS and
hipBLASLt (Tensile's ``Cijk_...`` kernels, ``hipblaslt``), cuDNN/MIOpen convolutions (counted as
GEMM: implicit GEMMs on the tensor cores), FlashAttention / memory-efficient / CK attention.
"""

from __future__ import annotations

import re

COMMUNICATION, MEMORY, COMPUTATION, OTHER = 0, 1, 2, 3

NCCL_KERNEL_RE = re.compile(r"^nccl.*Kernel")
MEMORY_KERNEL_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


def hta_type(name: str) -> int:
    if NCCL_KERNEL_RE.match(name):
        return COMMUNICATION
    if MEMORY_KERNEL_RE.match(name):
        return MEMORY
    if not NOT_COMPUTE_RE.match(name):
        return COMPUTATION
    return OTHER


CLASSES = ("gemm", "attention", "elementwise_reduction", "communication", "memcpy_memset", "other")

_ATTENTION = re.compile(r"flash|fmha|attention|_attn|sdpa|mem_eff|efficient_attention|FmhaFwd|FmhaBwd", re.I)
# ``(?<!fb)gemm``: FBGEMM-GPU's kernels (embedding lookups, permutes, FP8 quantization) carry
# ``fbgemm`` in their names and are no GEMMs. cuDNN's implicit-GEMM convolutions are named
# ``cudnn_<infer|train>_<arch>_scudnn_...`` (``hcudnn`` in half; ``relu`` or ``stridedB`` in the
# name is the fused epilogue or the layout, not an elementwise kernel) and its older engines
# ``wgrad_alg0_engine``, ``dgrad_engine``.
_GEMM = re.compile(
    r"(?<!fb)gemm|gemv|cutlass|xmma|cublas|nvjet|Cijk_|hipblaslt|matmul|_mm_|bmm|splitK|wgmma|"
    r"conv|cudnn::.*(fprop|dgrad|wgrad)|[sh]cudnn_|(wgrad|dgrad)_alg\d|(wgrad|dgrad|fprop)_engine|"
    r"winograd|miopen.*Conv|igemm|implicit", re.I)
_ELEMENTWISE = re.compile(
    r"elementwise|vectorized|unrolled|reduce|reduction|softmax|norm|index|scatter|gather|copy|"
    r"cat_|CatArray|fill|triton_|pointwise|where|embedding|dropout|adam|sgd|foreach|multi_tensor|"
    r"distribution|random|sum_|mean|max_|min_|arange|cast|bn_|batch_norm|layer_norm|relu|gelu|silu|pool", re.I)


def kernel_class(name: str, htype: int) -> str:
    if htype == COMMUNICATION or name.startswith(("rccl", "ncclDev")):
        return "communication"
    if htype == MEMORY:
        return "memcpy_memset"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    if _ELEMENTWISE.search(name):
        return "elementwise_reduction"
    return "other"


def short_name(name: str, limit: int = 80, *, templates: bool = False) -> str:
    """A kernel's name without its template and argument lists (for the terminal); ``templates``:
    keeps the template arguments (to tell apart two kernels of one name). A memcpy/memset's name
    as it is (HTA's ``shorten_name`` too): ``Memcpy HtoD (Pageable -> Device)`` says the copy
    was from pageable memory."""
    s = name
    if MEMORY_KERNEL_RE.match(s):
        return s if len(s) <= limit else s[: limit - 1] + "…"
    if s.startswith("void "):
        s = s[5:]
    opens, closes = ("(", ")") if templates else ("<(", ">)")
    depth, out = 0, []
    for ch in s:
        if ch in opens:
            depth += 1
            continue
        if ch in closes:
            depth = max(depth - 1, 0)
            continue
        if depth == 0:
            out.append(ch)
    s = "".join(out).strip() or name
    return s if len(s) <= limit else s[: limit - 1] + "…"


def short_names(names: list[str], limit: int = 80) -> list[str]:
    """:func:`short_name` of each, with the template arguments kept where two would read the same
    (``vectorized_elementwise_kernel`` of an add and of a threshold)."""
    first = [short_name(n, limit) for n in names]
    return [short_name(n, 2 * limit, templates=True) if first.count(s) > 1 else s for n, s in zip(names, first)]

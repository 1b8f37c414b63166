"""``stepwatch bench-comm``: the AllReduce sweep (see :mod:`stepwatch.comm.bench`)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-comm",
        help="nccl-tests-style AllReduce sweep (run under torchrun), busbw vs the reference baselines",
        description=(
            "AllReduce bandwidth sweep through torch.distributed, one process per rank: "
            "`torchrun --nproc-per-node 8 -m stepwatch bench-comm -b 1M -e 1G -f 2`. Prints nccl-tests' "
            "columns (size, count, type, redop, root, time, algbw, busbw) and, on H100s, the verdict "
            "against the reference baselines (B.5)."
        ),
    )
    p.add_argument("-b", "--minbytes", default="1M", help="smallest message (K/M/G suffixes; default 1M)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message (default 64M; 1G for the baselines)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier between rows (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("-d", "--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    p.add_argument("--backend", default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the rows to this JSON file (rank 0; its directory is checked before the sweep)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    """0; 2 for bad arguments (nothing printed on stdout, nothing run) or no torchrun; 1 when the
    sweep ran but its --json file could not be written."""
    from .bench import OutputError, parse_size, run

    try:
        b = parse_size(args.minbytes, "-b/--minbytes")
        e = parse_size(args.maxbytes, "-e/--maxbytes")
        if args.iters < 1 or args.warmup_iters < 0:
            raise ValueError("-n/--iters must be >= 1 and -w/--warmup_iters >= 0")
        run(b, e, args.stepfactor, args.iters, args.warmup_iters, args.dtype, args.backend, json_path=args.json)
    except OutputError as exc:
        sys.stdout.flush()  # the table first, then the one line
        print(f"stepwatch bench-comm: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:
        print(f"stepwatch bench-comm: {exc}", file=sys.stderr)
        return 2
    return 0

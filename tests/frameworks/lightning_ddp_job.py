"""2-rank Lightning DDP job (gloo, CPU), run by test_lightning.py under torchrun.

    torchrun --nproc-per-node 2 lightning_ddp_job.py OUT [--no-stepwatch | --no-callback]

With stepwatch (default): the one-line import plus the Lightning callback passed by hand;
``--no-callback``: the import alone (the entry point adds the callback unless
STEPWATCH_LIGHTNING_CALLBACK=0). Each rank writes what Lightning
saw (losses, tokens, grad norms) to OUT.rank<R>.json for the test to compare with the records.
"""

import json
import os
import sys

if "--no-stepwatch" not in sys.argv:
    import stepwatch.auto  # noqa: F401

from lit_common import fit


def main():
    out = sys.argv[1]
    callbacks = []
    if "--no-stepwatch" not in sys.argv and "--no-callback" not in sys.argv:
        from stepwatch.integrations.lightning import StepwatchCallback

        callbacks.append(StepwatchCallback())
    lit, trainer = fit(callbacks, devices=2, strategy="ddp")
    rank = trainer.global_rank
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"losses": lit.losses, "tokens": lit.tokens, "norms": lit.norms, "steps": trainer.global_step}, f)


if __name__ == "__main__":
    main()

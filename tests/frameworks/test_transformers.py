"""Hugging Face ``transformers.Trainer`` (gradient accumulation, its own clip_grad_norm_, evaluation
during training) with stepwatch, on CPU, checked against what the Trainer itself logs.

A tiny GPT-2 is built from a config (no hub download). Proves the transformers row of
docs/frameworks.md. Nothing is mocked.
"""

import pytest
import torch

import stepwatch
from fw_common import TokenData, batch_of, identity_holds, no_internal_errors, plain_loop_flops, start

STEPS, ACCUM, BS, EVAL_EVERY = 6, 2, 4, 3


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg)


def _train(tmp_path, callbacks):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    logs = []

    class Grab(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            grabbed.append((state.global_step, dict(logs or {})))

    grabbed = logs
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=BS,
        per_device_eval_batch_size=BS,
        gradient_accumulation_steps=ACCUM,
        max_grad_norm=0.5,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=_gpt2(),
        args=args,
        train_dataset=TokenData(STEPS * ACCUM * BS),
        eval_dataset=TokenData(BS),
        callbacks=[*callbacks, Grab()],
    )
    trainer.train()
    train_logs = {step: l for step, l in logs if "grad_norm" in l}
    return trainer, train_logs


def test_trainer_records_match_what_the_trainer_logs(tmp_path):
    from stepwatch.integrations.transformers import StepwatchCallback

    ref_flops = plain_loop_flops(tmp_path, _gpt2(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    trainer, logs = _train(tmp_path, [StepwatchCallback()])
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]  # the tail record: evaluation after the last step
    assert mem.records[-1].tail and mem.records[-1].eval_s > 0
    no_internal_errors(mem)
    assert trainer.state.global_step == STEPS
    # One record per optimizer step; record k is the Trainer's global_step k + 1.
    assert [r.step for r in recs] == list(range(STEPS))
    seen = 0
    for r in recs:
        log = logs[r.step + 1]
        assert identity_holds(r), r
        assert r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0 and r.data_wait_s > 0
        # The Trainer's clip_grad_norm_ returned this norm (pre-clip); stepwatch reused it.
        assert r.grad_norm == log["grad_norm"]
        assert r.scalars["loss"] == log["loss"] and r.scalars["lr"] == log["learning_rate"]
        # Tokens: non-padding tokens of the step's micro-batches, as the Trainer counts them.
        assert r.tokens == log["num_input_tokens_seen"] - seen
        seen = log["num_input_tokens_seen"]
        assert r.samples == ACCUM * BS
        assert r.flops == pytest.approx(ACCUM * ref_flops, rel=0.02)
    # Evaluation ran after steps 3 and 6: its time is eval_s of the step after, never step time.
    assert recs[EVAL_EVERY].eval_s > 0
    assert all(r.eval_s == 0 for i, r in enumerate(recs) if i != EVAL_EVERY)

    # Stepwatch off: the same losses and grad norms, bit for bit.
    _, logs_off = _train(tmp_path, [])
    assert [(l["loss"], l["grad_norm"]) for l in logs_off.values()] == [(l["loss"], l["grad_norm"]) for l in logs.values()]

"""A Hugging Face Trainer script on Zero3D (docs/hf_trainer.md), runnable without downloads.

    torchrun --nproc-per-node 2 scripts/train_hf_trainer.py [--config configs/hf_trainer_zero3.json] [--out DIR]
    zero3d launch --nproc-per-node 2 scripts/train_hf_trainer.py      # the same script, unchanged

A tiny random-init Llama learns a repeated token pattern; the script prints the loss of each
logged step on rank 0 and saves a from_pretrained directory to ``--out/final``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from parallel3d.hf import Trainer  # noqa: E402  (was: from transformers import Trainer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--config", default=os.path.join(here, "configs", "hf_trainer_zero3.json"))
    ap.add_argument("--out", default="hf_trainer_out")
    ap.add_argument("--steps", type=int, default=20)
    cli = ap.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    pattern = torch.arange(32) % 8
    data = [{"input_ids": pattern.roll(i), "labels": pattern.roll(i)} for i in range(64)]
    args = TrainingArguments(output_dir=cli.out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=cli.steps, learning_rate=3e-3, warmup_steps=2, logging_steps=5,
                             save_steps=10, report_to=[], disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available())  # accelerate's rule for torchrun on CPUs
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      zero3d_config=cli.config)  # was: TrainingArguments(..., deepspeed=cli.config)
    trainer.train()
    trainer.save_model(os.path.join(cli.out, "final"))
    if trainer.is_world_process_zero():
        print("losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main()

"""TRL's ``SFTTrainer`` through Zero3D (``parallel3d.hf.SFTTrainer``) on a small chat dataset at
ZeRO-3 over 2 data-parallel ranks: it trains (the loss falls on data it sees repeatedly) and
``save_model`` writes a directory ``from_pretrained`` loads with the engine's logits."""

from __future__ import annotations

import os

import torch

from tests.test_hf_trainer import PROBE, engine_logits, logged
from tests.test_job_chat import CHATML, CONVERSATIONS

STEPS = 6


def chat_tokenizer():
    from parallel3d.job.tokenizer import train_bpe

    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["<|im_start|>user\n<|im_end|>\n"] * 20
    tok = train_bpe(texts, 300)
    tok.chat_template = CHATML
    return tok


def sft_run(out: str) -> dict:
    from datasets import Dataset
    from trl import SFTConfig

    from parallel3d.hf import SFTTrainer
    from tests.tiny import make_model

    tok = chat_tokenizer()
    data = Dataset.from_list([{"messages": c} for c in CONVERSATIONS] * 4)
    args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS,
                     learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                     optim="adamw_torch", max_length=64, seed=0, disable_tqdm=True, dataset_num_proc=None)
    trainer = SFTTrainer(model=make_model("llama", vocab_size=len(tok)), args=args, train_dataset=data,
                         processing_class=tok, zero3d_config={"zero_optimization": {"stage": 3}})
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return {"losses": logged(trainer), "accuracy": logged(trainer, "mean_token_accuracy"),
            "logits": engine_logits(trainer)}


def test_sft_trainer_trains_and_saves_at_zero3(dist, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    results = dist.run(2, sft_run, str(tmp_path))
    got = results[0]
    assert len(got["losses"]) == STEPS and got["losses"][-1] < 0.8 * got["losses"][0]
    assert len(got["accuracy"]) == STEPS
    with torch.no_grad():
        reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "final")(input_ids=PROBE).logits
    torch.testing.assert_close(reloaded, got["logits"], rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "final").chat_template is not None

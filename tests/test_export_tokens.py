"""zero3d export of a job that trained its own tokenizer: what it prints, and the special token
ids of the exported config.json / generation_config.json (a pretrained model.path with Llama's
eos 2 / bos 1, trained with a byte-level BPE whose end-of-text is id 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from parallel3d.export.export import main as export_main
from parallel3d.export.tokens import trained_tokenizer
from tests.test_train_cli import tiny_job

ROOT = Path(__file__).resolve().parent.parent


def _pretrained_dir(path: Path, model_config: dict) -> None:
    """A random Llama saved as a model directory (no tokenizer) with its own generation config."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**model_config, vocab_size=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=9, repetition_penalty=1.0).save_pretrained(path)


class Forced:
    """A logits processor that makes token ``sequence[k]`` the only choice at new position k."""

    def __init__(self, sequence: list[int], prompt_len: int) -> None:
        self.sequence, self.prompt_len = sequence, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.sequence[input_ids.shape[1] - self.prompt_len]] = 0.0
        return forced


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path, str, str]:
    """Train 2 steps from the pretrained directory (tokenizer trained by the job), export:
    (hf dir, run dir, export's stdout, the train log)."""
    tmp = tmp_path_factory.mktemp("export-tokens")
    job = tiny_job(tmp / "run", max_steps=2, save_interval=2, eval_interval=0, progress=False)
    _pretrained_dir(tmp / "pretrained", job["model"]["config"])
    job["model"] = {"path": str(tmp / "pretrained")}
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, ZERO3D_CACHE=str(tmp / "cache"), PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(tmp / "job.yaml"), "--nproc-per-node",
                           "1"], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    train_log = proc.stderr
    out = tmp / "hf"
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "export", str(tmp / "run"), str(out)], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, tmp / "run", proc.stdout, train_log


def test_export_says_what_it_wrote(exported):
    from transformers import AutoModelForCausalLM

    out, run, stdout, _ = exported
    lines = stdout.splitlines()
    assert lines[0] == f"wrote {out} from {run / 'checkpoints' / 'global_step2'}:"
    listed = {line.split()[0]: line.split()[1:] for line in lines[1:] if line.startswith("  ")}
    assert set(listed) == {p.name for p in out.iterdir()}  # every file, none missing or invented
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(listed)
    size_kb = (out / "model.safetensors").stat().st_size / 1024
    assert listed["model.safetensors"] == [f"{size_kb:.1f}", "KB"]
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    assert f"{n:,} parameters (fp32) in 1 safetensors file" in stdout
    assert lines[-1] == "special tokens (generation_config.json): eos 0, bos 0, pad 0"


def test_exported_ids_are_the_trained_tokenizers(exported):
    out, _, _, _ = exported
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 0 and tok.convert_ids_to_tokens(2) != tok.eos_token  # id 2 is an ordinary token
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for ids in (config, generation):
        assert (ids["eos_token_id"], ids["bos_token_id"], ids["pad_token_id"]) == (0, 0, 0), ids
    assert generation["max_new_tokens"] == 9  # the model directory's own generation config carried over


def test_generate_on_the_export_stops_at_the_tokenizers_end_of_text(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    out, _, _, _ = exported
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = tok("def f():", return_tensors="pt")["input_ids"]
    forced = [2, 5, tok.eos_token_id, 7, 8, 9]  # Llama's default eos (2) first: generation must go past it
    got = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=6,
                         logits_processor=LogitsProcessorList([Forced(forced, prompt.shape[1])]))
    assert got[0, prompt.shape[1]:].tolist() == [2, 5, tok.eos_token_id]


def test_train_log_says_where_the_weights_came_from(exported):
    from safetensors import safe_open

    out, run, _, train_log = exported
    weights = run.parent / "pretrained" / "model.safetensors"
    with safe_open(weights, "pt") as f:
        count = len(list(f.keys()))
    lines = [line for line in train_log.splitlines() if "weights read from" in line]
    assert len(lines) == 1, train_log[-3000:]
    assert lines[0].endswith(f"model: weights read from {weights.resolve()} (model.path: {count} tensors, "
                             "0.14M values in 1 file)")


def test_which_jobs_trained_their_tokenizer(tmp_path):
    (tmp_path / "with_tok").mkdir()
    (tmp_path / "with_tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "without").mkdir()
    assert trained_tokenizer({"model": {"model_type": "llama"}, "tokenizer": {"vocab_size": 512}})
    assert trained_tokenizer({"model": {"path": str(tmp_path / "without")}, "tokenizer": {}})
    assert not trained_tokenizer({"model": {"path": str(tmp_path / "with_tok")}, "tokenizer": {}})
    assert not trained_tokenizer({"model": {"model_type": "llama"}, "tokenizer": {"path": str(tmp_path / "with_tok")}})


def test_export_main_prints_nothing_on_error(tmp_path, capsys):
    assert export_main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "does not exist" in captured.err

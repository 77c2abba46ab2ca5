"""The built-in default job of ``zero3d train`` with no config (configs/quickstart.yaml is this, as YAML).

A small Llama (about 4M parameters) on the CPython documentation that ships with Python
(``pydoc_data``), with a 4096-token byte-level BPE trained locally and cached, on 2 local CPU
processes with ZeRO stage 2: a few minutes on a 2-core machine.
"""

QUICKSTART: dict = {
    "model": {
        "model_type": "llama",
        "config": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
        "attn_implementation": "sdpa",
        "dtype": "auto",
    },
    "tokenizer": {"vocab_size": 4096},
    "data": {"builder": "pydoc", "seq_len": 128, "validation_fraction": 0.1},
    "engine": {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 50,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 30, "warmup_type": "linear",
            "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 2},
    },
    "train": {
        "max_steps": 300,
        "eval_interval": 50,
        "save_interval": 100,
        "keep_last": 2,
        "output_dir": "runs/quickstart",
        "seed": 1234,
        "resume": "auto",
        "nproc_per_node": 2,
    },
}

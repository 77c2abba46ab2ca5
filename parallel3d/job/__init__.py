"""``zero3d train``: config-driven training of HF causal LMs on the parallel3d engine.

One job each: `config` (the job schema and overrides), `defaults` (the built-in job),
`corpus` (the bundled CPython docs), `tokenizer`, `data` (load, tokenize, pack), `sampler`
(seeded, dp-sharded, resumable order), `model`, `checkpoints` (resume, keep-last-k),
`metrics` (bar, JSONL, TensorBoard, summary), `prepare` (everything before the engine),
`trainer` (the loop), `run` (the worker entry point); `plot` draws a run's curves
(``zero3d plot``).
"""

from parallel3d.job.config import JobConfig, load_job_config

__all__ = ["JobConfig", "load_job_config"]

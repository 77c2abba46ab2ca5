"""The job config of ``zero3d train``: model, tokenizer, data, engine and train sections.

    job = load_job_config("configs/llama-zero3.yaml", ["train.max_steps=200"])
    job = load_job_config(None)          # the built-in default (parallel3d/job/defaults.py)

A YAML or JSON file (or a dict) validated with the same rules and message style as the
engine config: every problem is one `ConfigError` naming the dotted key, the value and the
rule; an unknown key names the nearest known one. ``engine`` is the DeepSpeed-style engine
config, inline or a path to a ds_config.json used unchanged; it is validated here by the
engine's own schema (`parallel3d.config.config`) with keys reported under ``engine.``.

Command-line overrides ``key.sub=value`` are applied to the mapping before validation;
values are typed like YAML scalars (``1e-4`` is a number, ``true`` a bool, ``[a, b]`` a list).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from parallel3d.config.config import Zero3DConfig, read_config_file
from parallel3d.config.sections import (
    NonNegInt, PositiveInt, Section, describe_validation_error, problem, rule, show)
from parallel3d.errors import ConfigError

__all__ = ["JobConfig", "load_job_config", "apply_overrides", "parse_override", "engine_dict"]

BUILDERS = ("pydoc", "text", "json", "csv", "parquet", "arrow")
"""`data.builder`: the bundled CPython documentation corpus, or a `datasets` packaged builder."""
_EXTENSION_BUILDER = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                      ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class ModelConfig(Section):
    """`model`: an HF model type with config overrides (random init), or a local pretrained dir."""

    model_type: Optional[str] = None
    """A `transformers` model type ("llama", "gpt2", "qwen2", ...) built with random weights."""
    path: Optional[str] = None
    """A local Hugging Face directory (config.json and safetensors weights, as `save_pretrained` or
    `zero3d export` write them; no downloads). The model is built on the meta device from its
    config and each rank reads only the slices of the weights it holds."""
    config: dict[str, Any] = {}
    """Overrides of the model type's default config (hidden_size, num_hidden_layers, ...)."""
    attn_implementation: Optional[str] = "sdpa"
    """"sdpa", "eager", "flash_attention_2", ... (passed to transformers)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype; "auto" follows the engine (bf16/fp16 sections). Any other value must agree with it."""
    trust_remote_code: bool = False
    """Let model.path run its own Python code (a config.json with auto_map); false refuses such a
    directory (parallel3d/build/remote_code.py)."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.model_type is None) == (self.path is None):
            raise problem("model: give exactly one of model.model_type (random init from a config) "
                          "and model.path (a local pretrained directory)")
        if self.path is not None and self.config:
            raise problem("model.config overrides apply to model.model_type (random init); "
                          "with model.path edit the directory's config.json instead")
        return self

    @field_validator("model_type")
    @classmethod
    def _known_type(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return value
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if value not in CONFIG_MAPPING_NAMES:
            import difflib

            near = difflib.get_close_matches(value, list(CONFIG_MAPPING_NAMES), n=1)
            hint = f'; did you mean "{near[0]}"?' if near else "; e.g. llama, gpt2, qwen2, mistral"
            raise rule(f"is not a model type transformers knows{hint}")
        if value not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise rule("has no causal-LM class in transformers (AutoModelForCausalLM); "
                       "zero3d train needs a causal language model")
        return value


class TokenizerConfig(Section):
    """`tokenizer`: a local HF tokenizer directory, or the built-in byte-level BPE."""

    path: Optional[str] = None
    """A local tokenizer directory (AutoTokenizer); unset: model.path's tokenizer if it has one,
    else a byte-level BPE trained on the training text and cached under ~/.cache/zero3d."""
    vocab_size: PositiveInt = 4096
    """Vocabulary size of the built-in BPE."""
    max_train_chars: PositiveInt = 50_000_000
    """The built-in BPE learns from at most this many characters of training text."""
    trust_remote_code: bool = False
    """Let the tokenizer directory (tokenizer.path, or model.path's tokenizer) run its own Python
    code (a tokenizer_config.json with auto_map); false refuses such a directory."""
    chat_template: Optional[str] = None
    """A Jinja chat template (the template itself, or the path of a .jinja file) that replaces the
    tokenizer's for data.format chat; unset: the tokenizer's own."""

    @field_validator("vocab_size")
    @classmethod
    def _room_for_bytes(cls, value: int) -> int:
        if value < 300:
            raise rule("must be >= 300 (256 byte symbols, a few merges and the special token)")
        return value


class DataConfig(Section):
    """`data`: documents through `datasets`, tokenized and packed into blocks of seq_len tokens."""

    builder: Optional[str] = None
    """"pydoc" (the CPython documentation bundled with Python; the default when nothing else is
    given), or a datasets builder: text (one document per line), json, csv, parquet, arrow."""
    data_files: Union[str, list[str], dict[str, Union[str, list[str]]], None] = None
    """Local file(s) or glob(s) for the builder, or a mapping split -> file(s)."""
    path: Optional[str] = None
    """A dataset saved with `save_to_disk` (a Dataset, or a DatasetDict with splits)."""
    format: Literal["text", "chat"] = "text"
    """"text": documents in text_column, packed with EOS between them and cut into blocks (a
    document may span two; attention runs across the block). "chat": conversations ("messages",
    or "prompt"/"completion") rendered with the tokenizer's chat template, labelled on the
    assistant's turns only, and packed whole with position_ids restarting at each so that
    attention does not cross them (parallel3d/job/chat.py, parallel3d/job/packing.py); the engine's
    loss_normalization defaults to "tokens" then."""
    text_column: str = "text"
    """The column holding the document text (data.format text)."""
    seq_len: PositiveInt = 128
    """Tokens per training block; documents are packed with EOS between them (data.format text),
    or whole conversations are packed and a longer one is cut to seq_len (data.format chat)."""
    train_split: str = "train"
    """The split to train on."""
    validation_split: Optional[str] = None
    """A split of the dataset to validate on; unset: hold out validation_fraction of the documents."""
    validation_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of training documents held out for validation (chosen by train.seed); 0 = none."""
    num_proc: Optional[PositiveInt] = None
    """Processes for tokenization (datasets.map num_proc)."""

    @field_validator("builder")
    @classmethod
    def _known_builder(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in BUILDERS:
            raise rule(f"is not allowed; must be one of {', '.join(BUILDERS)}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        if self.path is not None and (self.builder is not None or self.data_files is not None):
            raise problem("data: give data.path (a dataset saved with save_to_disk) or "
                          "data.builder/data.data_files, not both")
        if self.builder == "pydoc" and self.data_files is not None:
            raise problem('data.data_files: the "pydoc" builder is the bundled corpus and takes no files; '
                          "set data.builder to text, json, csv, parquet or arrow, or remove data.builder to infer "
                          "it from the files' extension")
        if self.format == "chat" and self.source == "pydoc":
            raise problem('data.format "chat" needs conversations: JSONL files with "messages" (or "prompt" and '
                          '"completion") in data.data_files, or a dataset saved with save_to_disk in data.path')
        if self.builder not in (None, "pydoc") and self.data_files is None:
            raise problem(f'data.data_files is required with data.builder "{self.builder}" '
                          "(local files or globs; nothing is downloaded)")
        return self

    @property
    def source(self) -> str:
        """"pydoc", "disk", or the datasets builder name (inferred from data_files' extension)."""
        if self.path is not None:
            return "disk"
        if self.builder is not None:
            return self.builder
        if self.data_files is None:
            return "pydoc"
        files = self.data_files
        first = files if isinstance(files, str) else files[0] if isinstance(files, list) else next(iter(files.values()))
        first = first if isinstance(first, str) else first[0]
        suffix = Path(first).suffix.lower()
        if suffix not in _EXTENSION_BUILDER:
            raise ConfigError(f"data.builder is not set and the extension {suffix!r} of {first} does not tell "
                              f"the format; set data.builder to one of {', '.join(BUILDERS[1:])}")
        return _EXTENSION_BUILDER[suffix]


class TrainConfig(Section):
    """`train`: how long, how often to evaluate and save, where, and resumption."""

    max_steps: Optional[PositiveInt] = None
    """Optimizer steps to train (give this or epochs)."""
    epochs: Optional[float] = Field(None, gt=0)
    """Passes over the training blocks (give this or max_steps)."""
    eval_interval: NonNegInt = 50
    """Validate every this many steps (and at the start and the end); 0 = only start and end."""
    eval_batches: Optional[PositiveInt] = None
    """At most this many validation micro-batches per rank per evaluation; unset = all."""
    save_interval: NonNegInt = 0
    """Save a checkpoint every this many steps; 0 = only at the end."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    keep_last: PositiveInt = 2
    """Keep this many newest checkpoints; older ones are deleted once a new one is complete."""
    output_dir: str = "runs/quickstart"
    """Run directory: checkpoints/, tokenizer/, metrics.jsonl, job.yaml, summary.json."""
    seed: NonNegInt = 1234
    """Seeds model init, the validation hold-out and the data order."""
    resume: Union[bool, Literal["auto"]] = False
    """true: continue from output_dir/checkpoints/latest (must exist); "auto": if there is one;
    false: start fresh. A fresh start is refused when output_dir/checkpoints holds a checkpoint
    (`latest`, or any global_step<N> directory or directory with a checkpoint.json, as when
    `latest` was deleted), and, for false, when output_dir holds a non-empty metrics.jsonl."""
    save_on_signal: bool = False
    """On SIGTERM, SIGINT (Ctrl-C) or SIGHUP, save a checkpoint at the step where the job stops
    (every rank stops after the same step; a second Ctrl-C stops at once, without saving)."""
    nproc_per_node: PositiveInt = 1
    """Local worker processes for `zero3d train` (the --nproc-per-node flag overrides it)."""
    progress: bool = True
    """Show a tqdm bar on rank 0."""

    @model_validator(mode="after")
    def _one_length(self) -> "TrainConfig":
        if (self.max_steps is None) == (self.epochs is None):
            raise problem("train: give exactly one of train.max_steps and train.epochs")
        return self


class LoraSection(Section):
    """`lora`: train LoRA adapters (peft) on the frozen model; the keys are `peft.LoraConfig`'s
    (axolotl's `lora_r`/`lora_alpha`/`lora_dropout`/`lora_target_modules` are accepted too).
    The base is sharded like any frozen weight (ZeRO stage 3: 1/dp per rank), checkpoints hold
    the adapters only, and `zero3d export` writes a PEFT adapter directory."""

    renames: ClassVar[dict[str, str]] = {"lora_r": "r", "lora_target_modules": "target_modules"}

    r: PositiveInt = 8
    """The adapters' rank."""
    lora_alpha: float = Field(16.0, gt=0)
    """The adapters' output is scaled by lora_alpha / r (/ sqrt(r) with use_rslora)."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input."""
    target_modules: Union[str, list[str]] = "all-linear"
    """The modules to adapt: names (a module whose name is one of them or ends in "." + one of
    them: q_proj, v_proj, ...), one regular expression matched against whole module names, or
    "all-linear" (every Linear but the lm head)."""
    exclude_modules: Optional[list[str]] = None
    """Module names (as target_modules) left out."""
    layers_to_transform: Optional[list[NonNegInt]] = None
    """Only the blocks of these indices get adapters."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train as well: none, all, or those of the adapted layers."""
    use_rslora: bool = False
    """Rank-stabilized scaling lora_alpha / sqrt(r)."""
    init_lora_weights: Union[bool, Literal["gaussian"]] = True
    """true: lora_A as nn.Linear (Kaiming), lora_B zero; "gaussian": lora_A normal(1/r); false: both random."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: Union[str, list[str]]) -> Union[str, list[str]]:
        if not value or (isinstance(value, list) and not all(isinstance(v, str) and v for v in value)):
            raise rule('must name modules (a list such as [q_proj, v_proj], a regular expression or "all-linear")')
        return value


class JobConfig(Section):
    """A whole `zero3d train` job."""

    model: ModelConfig
    """The model to train."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """The tokenizer."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation data."""
    engine: Union[str, dict[str, Any]]
    """The DeepSpeed-style engine config inline, or the path of a ds_config.json/.yaml used unchanged."""
    train: TrainConfig
    """The training loop."""
    lora: Optional[LoraSection] = None
    """Train LoRA adapters on the frozen model (unset: train every parameter)."""

    @field_validator("engine")
    @classmethod
    def _engine_valid(cls, value: Union[str, dict]) -> Union[str, dict]:
        data = value
        if isinstance(value, str):
            if not Path(value).is_file():
                raise rule("does not exist; engine must be a DeepSpeed config inline or the path of a "
                           ".json/.yaml file")
            data = read_config_file(value)
        try:
            Zero3DConfig.model_validate(_fill_auto(data, 1))
        except ValidationError as err:
            raise problem(describe_validation_error(err, Zero3DConfig, prefix="engine")) from None
        return value


def engine_dict(job: JobConfig, total_steps: int | None = None) -> dict:
    """The engine config as a dict; inline configs get ``"auto"`` scheduler step counts filled in.
    Chat data, whose label counts differ from row to row, gets ``loss_normalization: "tokens"``
    unless the config sets it."""
    data = read_config_file(job.engine) if isinstance(job.engine, str) else _fill_auto(job.engine, total_steps or 1)
    if job.data.format == "chat" and "loss_normalization" not in data:
        data = {**data, "loss_normalization": "tokens"}
    return data


def _fill_auto(data: dict, total_steps: int) -> dict:
    """``scheduler.params.total_num_steps: auto`` -> the job's total optimizer steps (at least the warmup)."""
    scheduler = data.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    if not isinstance(params, dict) or params.get("total_num_steps") != "auto":
        return data
    data = copy.deepcopy(data)
    warmup = params.get("warmup_num_steps")
    floor = warmup if isinstance(warmup, int) and not isinstance(warmup, bool) else 1
    data["scheduler"]["params"]["total_num_steps"] = max(total_steps, floor)
    return data


# --- overrides ---------------------------------------------------------------------------------


class _ScalarLoader(yaml.SafeLoader):
    """YAML 1.2 numbers: 1e-4 and 5e8 are floats (PyYAML's 1.1 rules read them as strings)."""


_ScalarLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ScalarLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.max_steps=200"`` -> (["train", "max_steps"], 200)."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(re.fullmatch(r"[A-Za-z0-9_\-]+", p) for p in parts):
        raise ConfigError(f"override {text!r} must look like key.sub=value (e.g. train.max_steps=200)")
    try:
        value = yaml.load(raw, Loader=_ScalarLoader) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of ``data`` with each ``key.sub=value`` set (missing mappings are created)."""
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                if where == "engine":
                    raise ConfigError(f"override {text!r}: engine is the file {show(child)}, used unchanged; "
                                      "edit that file or give the engine config inline")
                raise ConfigError(f"override {text!r}: {where} is {show(child)}, not a mapping")
            node = child
        node[parts[-1]] = value
    return data


def _without_pydoc_for_files(data: dict, overrides: list[str]) -> dict:
    """Drop ``data.builder: pydoc`` (the built-in default's corpus) when the overrides give files
    or a saved dataset and no builder: ``data.data_files=x.jsonl`` then means those files, read by
    the builder their extension names, not "the pydoc builder takes no files"."""
    keys = {".".join(parse_override(text)[0]) for text in overrides}
    section = data.get("data")
    if (isinstance(section, dict) and section.get("builder") == "pydoc" and "data.builder" not in keys
            and keys & {"data.data_files", "data.path"}):
        data = {**data, "data": {k: v for k, v in section.items() if k != "builder"}}
    return data


def load_job_config(source: Union[str, Path, dict, None] = None, overrides: list[str] = ()) -> JobConfig:
    """Read, override and validate a job config; None means the built-in default."""
    if source is None:
        from parallel3d.job.defaults import QUICKSTART

        data = copy.deepcopy(QUICKSTART)
    elif isinstance(source, dict):
        data = copy.deepcopy(source)
    else:
        data = read_config_file(source)
    data = apply_overrides(_without_pydoc_for_files(data, list(overrides)), list(overrides))
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, JobConfig)) from None

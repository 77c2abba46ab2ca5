"""Job inputs that used to fail with a misleading message (issue 35): data files given over the
built-in default's "pydoc" builder."""

from __future__ import annotations

import pytest

from parallel3d.errors import ConfigError
from parallel3d.job.config import load_job_config
from tests.test_job_config import job


def test_data_files_over_the_default_job_use_the_builder_their_extension_names(tmp_path):
    files = tmp_path / "docs.jsonl"
    files.write_text('{"text": "a document"}\n')
    cfg = load_job_config(None, [f"data.data_files={files}"])
    assert cfg.data.builder is None and cfg.data.source == "json"
    assert load_job_config(None, [f"data.data_files={files}", "data.builder=json"]).data.source == "json"
    for config, overrides in ((None, [f"data.data_files={files}", "data.builder=pydoc"]),
                              (job(data={"builder": "pydoc", "data_files": str(files)}), [])):
        with pytest.raises(ConfigError) as info:
            load_job_config(config, overrides)
        assert str(info.value) == (
            'data.data_files: the "pydoc" builder is the bundled corpus and takes no files; set data.builder to text, '
            "json, csv, parquet or arrow, or remove data.builder to infer it from the files' extension")

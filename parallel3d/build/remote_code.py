"""``trust_remote_code``: whether a model or tokenizer directory may run its own Python code.

A Hugging Face directory whose ``config.json`` or ``tokenizer_config.json`` has an ``auto_map``
names classes in Python files of that directory; transformers imports (runs) them when
``trust_remote_code=True``, and without the argument asks "Do you wish to run the custom
code? [y/N]" on a terminal (or fails without one). Zero3D never decides this itself: the job's
``model.trust_remote_code`` / ``tokenizer.trust_remote_code`` (and ``zero3d plan
--trust-remote-code``) are false by default, as transformers' own default, every load passes
the setting, and with it false such a directory is refused before transformers sees it.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel3d.errors import ConfigError

CODE_FILES = ("config.json", "tokenizer_config.json")


def custom_code(directory: str | Path) -> tuple[str, list[str]] | None:
    """``(file, classes)`` of the first file in ``directory`` whose ``auto_map`` names code, or None."""
    for name in CODE_FILES:
        path = Path(directory) / name
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        auto_map = doc.get("auto_map") if isinstance(doc, dict) else None
        if auto_map:
            values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            classes = sorted({str(v) for value in values for v in (value if isinstance(value, list) else [value])
                              if v})
            return name, classes
    return None


def check_remote_code(directory: str | Path, trust: bool, setting: str) -> bool:
    """The ``trust_remote_code`` to pass for ``directory``; refuses its code unless ``trust``."""
    found = custom_code(directory)
    if found is not None and not trust:
        name, classes = found
        raise ConfigError(f"{directory} asks to run its own Python code ({name} has auto_map: "
                          f"{', '.join(classes[:3])}{', ...' if len(classes) > 3 else ''}); Zero3D runs such code only "
                          f"with {setting} set to true: set it if you trust the code in that directory")
    return trust

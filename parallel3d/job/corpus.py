"""The bundled corpus: the CPython documentation that ships with Python (``pydoc_data.topics``).

About 0.5 MB of real English (the language reference behind ``help("assert")`` etc.) in every
CPython install, so the built-in default trains without a download. Topics are split on blank
lines and consecutive paragraphs are merged into documents of about ``DOC_CHARS`` characters,
so a held-out validation fraction is many small documents rather than a few whole topics.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

DOC_CHARS = 2000


def pydoc_documents(doc_chars: int = DOC_CHARS) -> list[str]:
    """The documents of the bundled corpus, in a fixed order."""
    from pydoc_data import topics

    docs: list[str] = []
    for name in sorted(topics.topics):
        current = ""
        for para in re.split(r"\n\s*\n", topics.topics[name]):
            if not para.strip():
                continue
            current = f"{current}\n\n{para}" if current else para
            if len(current) >= doc_chars:
                docs.append(current)
                current = ""
        if current:
            docs.append(current)
    return docs


def pydoc_identity() -> dict:
    """What the corpus depends on, for cache keys: the topics file's hash and Python's version."""
    from pydoc_data import topics

    digest = hashlib.sha256(Path(topics.__file__).read_bytes()).hexdigest()[:16]
    return {"corpus": "pydoc_data.topics", "sha256": digest, "python": sys.version.split()[0],
            "doc_chars": DOC_CHARS}

"""The training corpus: the running interpreter's standard-library .py sources.

Every machine with Python has this text, so the default model can be rebuilt
anywhere. The file list is sorted and the held-out split is a pure function of
the path, so the corpus is deterministic for a given Python build.

Decisions (recorded in the model card): site-packages is excluded; test
directories (``test``, ``tests``, ``idle_test``) are excluded (they are large,
unidiomatic and would not fit the time budget); files that are not valid UTF-8
are skipped.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
HELD_OUT_MODULUS = 50


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the stdlib root and its text."""

    relpath: str
    text: str

    @property
    def num_bytes(self) -> int:
        """The text's size in UTF-8."""
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Corpus:
    """The split corpus and where it came from."""

    root: str
    python_version: str
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]
    skipped: tuple[str, ...]

    @property
    def train_bytes(self) -> int:
        return sum(d.num_bytes for d in self.train)

    @property
    def held_out_bytes(self) -> int:
        return sum(d.num_bytes for d in self.held_out)


def is_held_out(relpath: str) -> bool:
    """The fixed split rule: sha1(relative posix path) mod 50 == 0."""
    digest = hashlib.sha1(relpath.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELD_OUT_MODULUS == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """Read and split the stdlib sources.

    ``max_files`` (smoke tests only) keeps the first N train files and the first
    N held-out files of the sorted list.
    """
    root = root or stdlib_root()
    paths = sorted(
        (p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    train: list[Document] = []
    held_out: list[Document] = []
    skipped: list[str] = []
    for path in paths:
        relpath = path.relative_to(root).as_posix()
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(relpath)
            continue
        (held_out if is_held_out(relpath) else train).append(Document(relpath, text))
    if max_files is not None:
        train, held_out = train[:max_files], held_out[:max_files]
    corpus = Corpus(str(root), platform.python_version(), tuple(train), tuple(held_out), tuple(skipped))
    logger.info(
        "corpus %s (Python %s): %d train files (%d bytes), %d held-out files (%d bytes), %d skipped",
        root, corpus.python_version, len(train), corpus.train_bytes, len(held_out), corpus.held_out_bytes, len(skipped),
    )
    return corpus

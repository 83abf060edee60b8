"""The held-out benchmark prompts shared by the speculation benchmarks (bench_spec, bench_k3_spec, bench_gateway).

Both embedded models (their targets and their drafts) trained only on the standard library's train split
(training/corpus.py: a file is held out when sha1(path) % 50 == 0; the drafts trained on the targets' greedy
continuations of train-split prompts). The prompts here come from the held-out files only, and are chosen to
cover different kinds of text, since acceptance (and so the speculative speed-up) depends strongly on what is
being continued: each prompt ends at the end of a line of one KIND (a `def` line, the first line of a
docstring, a comment, ...), so the model continues into that kind of text. Per kind the matches are taken
evenly spaced over all held-out matches (different files where there are several), so the set is fixed for a
given Python build and tokenizer. Each prompt is the last `length` tokens before its end.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from benchmarks.common import make_prompts

DEFAULT_COUNT = 16  # the spec benchmarks' single-stream set: 2 prompts of each of the 8 kinds

KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("function body", r"^\s*def \w+\(.*\)( -> .+)?:$"),
    ("class body", r"^class \w+.*:$"),
    ("docstring", r'^\s*(r|b)?"""\w'),
    ("comment", r"^\s*# \w"),
    ("imports", r"^(import|from) [\w.]+"),
    ("control flow", r"^\s+(if|elif|for|while|with|try|except)\b.*:$"),
    ("data literal", r"^\s*('[^']*'|\d+),?\s*(#.*)?$|^\s*\w+ = [\[{(]$|^\s*'[^']*': "),
    ("error handling", r"^\s+raise \w+"),
))


class BenchPrompt(NamedTuple):
    kind: str  # one of KINDS, or "random" (no tokenizer: uniform random ids)
    where: str  # held-out file and line the prompt ends at
    token_ids: list[int]


def _candidates() -> dict[str, list[tuple[str, str, int]]]:
    """kind -> [(file relpath, file text, end offset of the matching line)] over the held-out files, in order."""
    from training.corpus import load_corpus

    found: dict[str, list[tuple[str, str, int]]] = {name: [] for name, _ in KINDS}
    for document in load_corpus().held_out:
        offset = 0
        for line_number, line in enumerate(document.text.split("\n"), start=1):
            end = offset + len(line)
            for name, pattern in KINDS:
                if pattern.search(line):
                    found[name].append((f"{document.relpath}:{line_number}", document.text, end))
                    break
            offset = end + 1
    return found


def _spaced(count: int, total: int) -> list[int]:
    """count indices evenly spaced over range(total), then the rest in order (fallbacks)."""
    first = sorted({min(total - 1, (2 * j + 1) * total // (2 * count)) for j in range(count)})
    return first + [i for i in range(total) if i not in set(first)]


def held_out_prompts(model_dir: Path | str, count: int, length: int, vocab_size: int, avoid: Sequence[int] = (),
                     seed: int = 0) -> tuple[list[BenchPrompt], str]:
    """`count` prompts of exactly `length` tokens, the kinds taking turns (prompt i has kind i % len(KINDS)),
    from the held-out files tokenized with the model's tokenizer.json. Without a tokenizer (random
    checkpoints): uniform random ids (make_prompts). Returns (prompts, a description of where they came from)."""
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    tokenizer = None
    if tokenizer_file.is_file():
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except ImportError:
            tokenizer = None
    if tokenizer is None:
        ids, source = make_prompts(Path(model_dir), count, length, seed, vocab_size, avoid)
        return [BenchPrompt("random", "-", p) for p in ids], source
    banned = set(avoid)
    per_kind = -(-count // len(KINDS))
    chosen: dict[str, list[BenchPrompt]] = {}
    for name, matches in _candidates().items():
        picked: list[BenchPrompt] = []
        for index in _spaced(per_kind, len(matches)) if matches else []:
            where, text, end = matches[index]
            ids = tokenizer.encode(text[max(0, end - 16 * length) : end]).ids
            if len(ids) > length and all(t < vocab_size and t not in banned for t in ids[-length:]):
                picked.append(BenchPrompt(name, where, ids[-length:]))
            if len(picked) == per_kind:
                break
        if len(picked) < per_kind:
            raise ValueError(f"only {len(picked)} held-out prompts of kind {name!r} with {length} tokens")
        chosen[name] = picked
    prompts = [chosen[name][i] for i in range(per_kind) for name, _ in KINDS][:count]
    return prompts, f"{count} held-out stdlib prompts of {len(KINDS)} kinds (benchmarks/prompts.py), model tokenizer"

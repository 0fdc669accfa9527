"""A benchmark table written as Markdown and JSON after every row (a killed run keeps its rows)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax


def log(*parts) -> None:
    """One progress line, flushed (the GPU machine returns only what was printed)."""
    print(*parts, flush=True)


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log v)) of positive values (nan when there are none)."""
    v = [float(x) for x in values if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def run_meta(preset) -> dict:
    """Date, commit (``DOSA_COMMIT`` or git), device, jax version, command line and preset."""
    commit = os.environ.get("DOSA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit or "unknown",
                device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                jax=jax.__version__, command="python -m benchmarks " + " ".join(sys.argv[1:]),
                preset=preset._asdict())


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        a = abs(v)
        return f"{v:.3f}" if a < 10 else f"{v:.1f}" if a < 1000 else f"{v:.0f}"
    return str(v)


class Table:
    """Rows of named columns; :meth:`add` appends a row and rewrites ``<out>/<name>.md`` and
    ``.json``. ``summary(rows) -> {label: value}`` adds lines under the table."""

    def __init__(self, name: str, title: str, columns: Sequence[Tuple[str, str]], out: str,
                 meta: dict, notes: Sequence[str] = (),
                 summary: Optional[Callable[[List[dict]], Dict[str, object]]] = None):
        self.name, self.title, self.columns, self.out = name, title, list(columns), out
        self.meta, self.notes, self.summary_fn = meta, list(notes), summary
        self.rows: List[dict] = []
        self.errors: List[str] = []
        os.makedirs(out, exist_ok=True)

    @property
    def stem(self) -> str:
        """The output file name: the preset's, with ``meta["tag"]`` appended when set."""
        tag = self.meta.get("tag")
        return f"{self.name}_{tag}" if tag else self.name

    @property
    def md_path(self) -> str:
        return os.path.join(self.out, f"{self.stem}.md")

    @property
    def json_path(self) -> str:
        return os.path.join(self.out, f"{self.stem}.json")

    def summary(self) -> Dict[str, object]:
        return self.summary_fn(self.rows) if self.summary_fn else {}

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def error(self, what: str) -> None:
        self.errors.append(what)
        self.write()

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# {self.title}", "",
                 f"{m['date']}; commit {m['commit']}; {m['device']} ({m['backend']}); "
                 f"jax {m['jax']}; `{m['command']}`", ""]
        lines += ["| " + " | ".join(h for _, h in self.columns) + " |",
                  "|" + "---|" * len(self.columns)]
        for r in self.rows:
            lines.append("| " + " | ".join(_cell(r.get(k)) for k, _ in self.columns) + " |")
        lines.append("")
        for k, v in self.summary().items():
            lines.append(f"- {k}: {_cell(v)}")
        lines += [f"- {n}" for n in self.notes]
        lines += [f"- ERROR: {e}" for e in self.errors]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        with open(self.md_path, "w") as f:
            f.write(self.markdown())
        with open(self.json_path, "w") as f:
            json.dump(dict(meta=self.meta, columns=self.columns, rows=self.rows,
                           summary=self.summary(), notes=self.notes, errors=self.errors),
                      f, indent=1, default=str)

"""The research notebooks execute headless on CPU and show what they claim.

Each notebook in ``notebooks/`` is run top to bottom in a fresh ``python3``
kernel of *this* interpreter (nbclient; the ``notebooks`` extra), with a
timeout; no cell may raise, and the cells that carry the notebook's claims
must print them (e.g. the exactness check prints ``exact: True``). The
committed copy must be stored executed (outputs and figures embedded).

Checking never rewrites the committed file: the test writes the executed copy to a
temporary directory, as does the documented command (``notebooks/README.md``)::

    jupyter execute notebooks/01_certificate_walkthrough.ipynb \
        --output=/tmp/dosa_notebooks/01_certificate_walkthrough.ipynb

After editing a notebook, store it executed (the one command that writes in place)::

    python tests/test_notebooks.py --inplace notebooks/01_certificate_walkthrough.ipynb
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WALKTHROUGH = NOTEBOOKS / "01_certificate_walkthrough.ipynb"
#: per-cell limit in seconds (the whole walkthrough takes a few minutes on a 2-core CPU)
TIMEOUT_S = int(os.environ.get("DOSA_NOTEBOOK_TIMEOUT", 900))

#: text each notebook must print (one substring per claim)
EXPECTED_OUTPUT = {
    WALKTHROUGH.name: (
        "data: ",                                   # which data source was used
        "τ_final == dense τ* for every query and strategy: True",
        "seeds module reproduces the pipeline's tau_seed: True",
        "U ≥ s on every visible key up to float32 rounding: True",
        "float64: max |Σ terms − (U − s)|",          # Eq. 14 check printed
        "float64: U ≥ s on every visible key (to 2^-40 of M): True",
        "no Top-K key is rejected: True",
        "U^num >= real-number U on every screened key: True",
        "U^num >= s^ref (the scorer's float32 score) on every screened key of every query: True",
        "D_DoSA / D_base",                            # cost model evaluated
        "exact: True",                                # Theorem 1
    ),
}
MIN_FIGURES = {WALKTHROUGH.name: 7}
SLACK_TRAINING = NOTEBOOKS / "02_slack_training.ipynb"
EXPECTED_OUTPUT[SLACK_TRAINING.name] = (
    "data: ",
    "slack_loss is the mean smooth indicator over the keys outside the Top-K: True",
    "U ≥ s on every visible key (float32 rounding): True",
    "gradient finite and non-zero: True",
    "certificate derivative matches the central difference (1 %): True",
    "λ > 0 lowers the held-out slack loss: True",
    "H200 results: ",                               # benchmarks/results/slack_finetune_h200.json
    "timed rows; DoSA == dense bitwise on all of them: True",
    "geometric mean dense/DoSA over 8 timed rows",
    "H=32 λ=1, 85 steps: 8 timed cases",            # section 5: the fine-tunes' matrices
    "H=64 λ=1, 85 steps: 8 timed cases",
    # the committed slack weights with κ = 8: both targets on every case
    "H=32 λ=3, layer 0 ×4 (committed), κ=8: 8 timed cases, dense/DoSA 2.261-2.509",
    "H=64 λ=3, layer 0 ×4 (committed), κ=8: 8 timed cases, dense/DoSA 2.666-3.299",
    ">= 2x and <= 5 % on both: 8 of 8; bitwise on all: True",
    "λ=1, 85 steps: largest coverage drop: -0.14 points",
    "survival <= 5 % on 4 of 8 indexers",
    "λ=3, 85 steps: largest coverage drop: -0.05 points",
    "survival <= 5 % on 6 of 8 indexers",
    "λ=3, layer 0 ×4, 85 steps (committed): largest coverage drop: 0.37 points",
)
#: sections 1–3 one figure each; section 4 the coverage plot and survival, work, dense/DoSA;
#: section 5 the matrix of the indexer sets at H = 32 and at H = 64
MIN_FIGURES[SLACK_TRAINING.name] = 9


#: the headless test's walkthrough: 16 queries over 8192 keys (K = 2048: the seeds still
#: leave keys to screen and prune), two of the four seed strategies (union, the default, and
#: sinks, whose candidate buffers overflow into exact merges) and one of the four ablations;
#: each configuration left out is one compilation of the pipeline or of the budget sweep less
#: (every strategy and ablation is checked against the dense path by tests/test_exactness.py).
#: The committed copy is executed at the notebook's own defaults (32 queries, 16384 keys, all
#: strategies and ablations).
TEST_ENV = {"DOSA_NB_QUERIES": "16", "DOSA_NB_KEYS": "8192", "DOSA_NB_STRATEGIES": "union,sinks",
            "DOSA_NB_ABLATIONS": "1"}


def execute(path: pathlib.Path, timeout: int = TIMEOUT_S, defaults=None):
    """Run a notebook in a fresh kernel of this interpreter; return the executed notebook.

    ``defaults``: environment variables set for the kernel unless already set."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    env = dict(defaults or {}, **os.environ)
    env.update(JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), MPLBACKEND="Agg")
    # the kernel imports dosa_jax from the repository even without `pip install -e .`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    # "python3" runs this interpreter: jupyter_client maps the spec's bare "python" (or
    # ipykernel's built-in spec) to sys.executable; env reaches the kernel process
    client.execute(env=env)
    return nb


def cell_text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o.get("text", ""))
        elif o.get("output_type") in ("execute_result", "display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
        elif o.get("output_type") == "error":
            out.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "".join(out)


def count_figures(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))


def check_outputs(nb, name: str):
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{name}: a cell raised {errors[0].get('ename')}: {errors[0].get('evalue')}"
    missing = [c.source[:60] for c in code if not c.get("outputs")]
    assert not missing, f"{name}: code cells without output: {missing}"
    text = "\n".join(cell_text(c) for c in code)
    for needle in EXPECTED_OUTPUT.get(name, ()):
        assert needle in text, f"{name}: expected output {needle!r} not printed"
    assert count_figures(nb) >= MIN_FIGURES.get(name, 1), f"{name}: too few figures"


def test_committed_notebook_is_executed():
    """The stored notebook carries its outputs and figures (readable without running it)."""
    nbformat = pytest.importorskip("nbformat", reason="the `notebooks` extra is not installed")
    nb = nbformat.read(str(WALKTHROUGH), as_version=4)
    check_outputs(nb, WALKTHROUGH.name)


@pytest.mark.slow
def test_walkthrough_executes_headless(tmp_path):
    """Execute the walkthrough on CPU (at TEST_ENV's size unless the environment says
    otherwise): no cell errors, the claims are printed; the committed file is untouched
    (the executed copy goes to a temporary directory)."""
    nbformat = pytest.importorskip("nbformat", reason="the `notebooks` extra is not installed")
    pytest.importorskip("nbclient", reason="the `notebooks` extra (nbclient) is not installed")
    pytest.importorskip("ipykernel", reason="the `notebooks` extra (ipykernel) is not installed")
    pytest.importorskip("matplotlib", reason="the `notebooks` extra (matplotlib) is not installed")
    committed = WALKTHROUGH.read_bytes()
    t = time.perf_counter()
    nb = execute(WALKTHROUGH, defaults=TEST_ENV)
    nbformat.write(nb, str(tmp_path / WALKTHROUGH.name))
    check_outputs(nb, WALKTHROUGH.name)
    assert WALKTHROUGH.read_bytes() == committed, "executing the notebook rewrote the committed file"
    print(f"{WALKTHROUGH.name} executed in {time.perf_counter() - t:.0f}s "
          f"(copy in {tmp_path / WALKTHROUGH.name})")


def test_committed_slack_training_notebook_is_executed():
    nbformat = pytest.importorskip("nbformat", reason="the `notebooks` extra is not installed")
    check_outputs(nbformat.read(str(SLACK_TRAINING), as_version=4), SLACK_TRAINING.name)


def test_slack_training_executes_headless(tmp_path):
    """The slack-training notebook on CPU (about a minute on 2 cores); the committed file
    is untouched."""
    nbformat = pytest.importorskip("nbformat", reason="the `notebooks` extra is not installed")
    pytest.importorskip("nbclient", reason="the `notebooks` extra (nbclient) is not installed")
    pytest.importorskip("ipykernel", reason="the `notebooks` extra (ipykernel) is not installed")
    pytest.importorskip("matplotlib", reason="the `notebooks` extra (matplotlib) is not installed")
    committed = SLACK_TRAINING.read_bytes()
    nb = execute(SLACK_TRAINING)
    nbformat.write(nb, str(tmp_path / SLACK_TRAINING.name))
    check_outputs(nb, SLACK_TRAINING.name)
    assert SLACK_TRAINING.read_bytes() == committed


if __name__ == "__main__":  # python tests/test_notebooks.py [--inplace] NB...
    import nbformat

    args = sys.argv[1:]
    inplace = "--inplace" in args
    paths = [a for a in args if a != "--inplace"] or [str(WALKTHROUGH)]
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="dosa_notebooks_"))
    for arg in paths:
        p = pathlib.Path(arg).resolve()
        t = time.perf_counter()
        nb = execute(p)
        copy = out_dir / p.name
        nbformat.write(nb, str(copy))
        check_outputs(nb, p.name)  # raises (the executed copy is in out_dir) if a claim is missing
        if inplace:
            nbformat.write(nb, str(p))
        print(f"{p.name}: executed and checked in {time.perf_counter() - t:.0f}s; "
              f"{'written in place' if inplace else f'copy in {copy}'}")

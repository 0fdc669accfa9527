"""The command line ``python -m dosa_jax``: help, argument errors, warnings and a real run."""

import contextlib
import io
import os
import pathlib
import subprocess
import sys

from absl.testing import absltest, parameterized

import dosa_jax
from dosa_jax import __main__ as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: a small synthetic problem: every test that runs it shares one compilation
SMALL = ["--T", "8", "--N", "512", "--H", "8", "--D", "16", "--K", "32", "--repeats", "1"]


def run_main(argv):
    """(exit status, stderr) of ``main(argv)`` for arguments that argparse rejects."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(argv)
        except SystemExit as e:
            status = e.code
    return status, err.getvalue()


class HelpTest(absltest.TestCase):

    def test_every_option_has_help_and_a_shown_default(self):
        parser = cli.build_parser()
        options = [a for a in parser._actions if a.dest != "help"]
        for a in options:
            self.assertTrue(a.help, f"{a.option_strings} has no help text")
        text = " ".join(parser.format_help().split())  # the help wraps lines anywhere
        self.assertEqual(text.count("(default:"), len(options), text)
        for shown in ("(default: trained)", "(default: auto)", "(default: 512)",
                      "(default: union)", "(default: float8_e4m3fn)"):
            self.assertIn(shown, text)

    def test_help_exits_zero(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as e:
            cli.main(["--help"])
        self.assertEqual(e.exception.code, 0)
        self.assertIn("--backend", out.getvalue())

    def test_choices_are_what_config_accepts(self):
        for s in cli.SEED_STRATEGIES:
            self.assertEqual(dosa_jax.Config(seed_strategy=s).seed_strategy, s)
        for b in cli.BACKENDS:
            self.assertEqual(dosa_jax.Config(backend=b).backend, b)


class ArgumentErrorTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("bad_choice", ["--seed-strategy", "foo"], "--seed-strategy"),
        ("bad_backend", ["--backend", "tpu"], "--backend"),
        ("bad_data", ["--data", "random"], "--data"),
        ("t_above_n", ["--data", "structured", "--T", "512", "--N", "256"], "--T"),
        ("k_above_visible", ["--K", "5000"], "--K"),
        ("zero_queries", ["--T", "0"], "--T"),
        ("not_an_int", ["--N", "many"], "--N"),
        ("budget_above_h_minus_1", ["--retained", "40"], "--retained"),
        ("budget_h", ["--retained", "32"], "--retained"),
        ("budget_zero", ["--retained", "0"], "--retained"),
        ("budget_word", ["--retained", "most"], "--retained"),
        ("one_head", ["--data", "gaussian", "--H", "1"], "--H"),
        ("trained_heads", ["--H", "48"], "--H"),
        ("seed_on_trained", ["--seed", "3"], "--seed"),
        ("dim_on_trained", ["--D", "64"], "--D"),
        ("layer_on_synthetic", ["--data", "gaussian", "--layer", "2"], "--layer"),
        ("domain_on_synthetic", ["--data", "structured", "--domain", "prose"], "--domain"),
        ("bad_layer", ["--layer", "7"], "--layer"),
        ("negative_seed", ["--data", "gaussian", "--seed", "-1"], "--seed"),
        ("abbreviation", ["--ret", "4"], "--ret"),
        ("witnesses_not_blocks", ["--block-witnesses", "100"], "--block-witnesses"),
        ("negative_witnesses", ["--block-witnesses", "-64"], "--block-witnesses"),
        ("word_witnesses", ["--block-witnesses", "many"], "--block-witnesses"),
    )
    def test_refused_with_status_2_naming_the_option(self, argv, option):
        status, err = run_main(argv)
        self.assertEqual(status, 2, err)
        self.assertIn("error:", err)
        self.assertIn(option, err)

    @parameterized.parameters(
        (["--N", "1024", "--key-dtype", "bfloat16"], dict(N=1024, key_dtype="bfloat16")),
        (["--data", "gaussian", "--D=64", "--seed", "5"], dict(D=64, seed=5)),
        (["--retained", "31"], dict(retained=31)),
        (["--block-witnesses", "4096"], dict(block_witnesses=4096)),
        (["--block-witnesses", "0"], dict(block_witnesses=0)),
        (["--block-witnesses", "auto"], dict(block_witnesses=None)),
        ([], dict(block_witnesses=None)),
        (["--data", "structured", "--H", "8", "--retained", "7", "--backend", "reference"],
         dict(H=8, retained=7, backend="reference")),
    )
    def test_accepted_values_are_used(self, argv, expected):
        args = cli.parse_args(argv)
        for name, value in expected.items():
            self.assertEqual(getattr(args, name), value)


class ThresholdReportTest(absltest.TestCase):

    def test_ratio_only_where_tau_star_is_positive(self):
        import numpy as np
        tau = np.array([1.0, -3.0, -np.inf])
        tau_star = np.array([2.0, -1.0, 5.0])
        lines = cli.threshold_lines(tau, tau_star)
        self.assertIn("tau/tau*: median 0.500", lines[0])
        self.assertIn("(1 queries with tau* > 0)", lines[0])
        self.assertIn("threshold gap): median 2", lines[1])
        self.assertIn("1 queries without a seed threshold", lines[2])
        self.assertEqual(len(cli.threshold_lines(tau[:1], tau_star[:1])), 1)


class RunTest(absltest.TestCase):

    def test_gaussian_data_warns_that_little_is_pruned(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertLogs("absl", level="WARNING") as logs:
            status = cli.main(["--data", "gaussian"] + SMALL)
        self.assertEqual(status, 0)
        self.assertIn("DoSA == dense (indices, bitwise): True", out.getvalue())
        warning = "\n".join(logs.output)
        self.assertIn("DoSA pruned only", warning)
        self.assertIn("random Gaussian keys have no geometry", warning)

    def test_structured_run_is_exact_and_does_not_warn(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertNoLogs("absl", level="WARNING"):
            status = cli.main(["--data", "structured"] + SMALL)
        self.assertEqual(status, 0)
        text = out.getvalue()
        self.assertIn("DoSA == dense (indices, bitwise): True   (scores: True)", text)
        self.assertIn("survival rate:", text)

    def test_command_line_run_on_the_trained_fixture(self):
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        proc = subprocess.run(
            [sys.executable, "-m", "dosa_jax", "--T", "8", "--K", "128", "--repeats", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertIn("DoSA == dense (indices, bitwise): True   (scores: True)", proc.stdout)
        for stage in ("loading trained-indexer data", "DoSA: compiling", "DoSA: median",
                      "dense: first call"):
            self.assertIn(stage, proc.stderr)
        self.assertIn("data: trained (fixture)  T=8 N=4096 H=32 D=128 K=128 keys=float8_e4m3fn "
                      "+scale", proc.stderr)


if __name__ == "__main__":
    absltest.main()

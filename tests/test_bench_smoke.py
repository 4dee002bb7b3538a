"""Every `ssmkit bench` runs end to end with `--shapes small` and prints its whole table."""

import re
import sys
import time
import types

import jax
import numpy as np
import pytest

from ssmkit import cli
from ssmkit.bench import _timing
from ssmkit.bench import layers as layers_bench
from ssmkit.bench import linear_attention as la_bench

METHODS = (
    "lax.scan",
    "lax.associative_scan",
    "ssmkit auto",
    "ssmkit sequential",
    "ssmkit parallel",
    "ssmkit chunked/seq",
    "ssmkit chunked/par",
)


def test_bench_scan_small_prints_every_method_shape_and_criterion(capsys):
  status = cli.main(["bench", "scan", "--shapes", "small", "--repeats", "2"])
  out = capsys.readouterr().out
  assert status == 0
  for name in METHODS:
    assert f" {name} " in out
  for shape in ("T=64 D=2", "B=2 T=16 D=2"):
    assert shape in out
  # Microsecond timings judge nothing: the criteria are left to the full suite.
  assert "PASS" not in out and "FAIL" not in out and "judged on the full suite only" in out


def test_bench_sequence_parallel_small_splits_over_the_devices_there_are(capsys):
  assert cli.main(["bench", "sequence-parallel", "--shapes", "small", "--repeats", "2",
                   "--layers", "Attention"]) == 0
  out = capsys.readouterr().out
  devices = jax.devices()
  if len(devices) < 2:  # e.g. one GPU: the notice says how to get host devices
    assert "needs at least 2 devices" in out
    return
  for text in (" one device ", f" sequence-parallel x{len(devices)} ", "T=64 D=2", " ppermute ",
               " gather ", "Attention "):
    assert text in out
  assert "LRU " not in out.split("Every layer")[-1]
  # Host devices share one machine: the table says it is no speed claim, on CPU only.
  assert ("not a speed claim" in out) == (devices[0].platform == "cpu")


def test_bench_rl_small_checks_every_mode_against_rlax(capsys):
  status = cli.main(["bench", "rl", "--shapes", "small", "--repeats", "2"])
  out = capsys.readouterr().out
  assert status == 0
  for name in ("rlax", "ssmkit auto", "ssmkit sequential", "ssmkit parallel", "ssmkit chunked"):
    assert f" {name} " in out
  for case in ("GAE (T, B) T=33 B=4", "returns (B, T) T=17 B=3", "returns T=50",
               "V-trace (T, B) T=21 B=3", "Retrace (B, T) T=19 B=2"):
    assert case in out
  assert "PASS" not in out and "FAIL" not in out and "judged on the full suite only" in out


def test_bench_layers_small_prints_its_layers_and_both_block_layouts(capsys):
  # The LRU alone: every mode and the depth sweep; the other layers' rows are the same code.
  status = cli.main(["bench", "layers", "--shapes", "small", "--repeats", "2", "--layers", "LRU"])
  out = capsys.readouterr().out
  assert status == 0
  assert "LRU " in out
  for name in (" sequential ", " parallel ", "unrolled", "nn.scan", " init s "):
    assert name in out


def test_bench_layers_runs_only_the_layers_asked_for(capsys):
  status = cli.main(["bench", "layers", "--shapes", "small", "--repeats", "2", "--layers", "Mamba2"])
  out = capsys.readouterr().out
  assert status == 0
  assert "Layers at their defaults: Mamba2." in out and "Mamba2 " in out and "LRU " not in out
  assert "nn.scan" not in out  # the depth sweep builds LRU models: skipped without LRU
  assert cli.main(["bench", "layers", "--shapes", "small", "--layers", "GRU"]) == 2
  assert "unknown layer(s) GRU" in capsys.readouterr().err


def test_bench_sequence_parallel_on_one_device_says_how_to_get_more(capsys, monkeypatch):
  first = jax.devices()[:1]
  monkeypatch.setattr(jax, "devices", lambda *args: first)
  assert cli.main(["bench", "sequence-parallel", "--shapes", "small"]) == 0
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in capsys.readouterr().out


def test_bench_training_small_times_a_config_and_shards_the_memory(capsys):
  args = ["bench", "training", "--shapes", "small", "--repeats", "2"]
  assert cli.main([*args, "--configs", "lm_mamba"]) == 0
  out = capsys.readouterr().out
  assert "lm_mamba " in out and "lm_attention" not in out and " 2x16 " in out
  held = {}
  for line in out.splitlines():
    match = re.match(r"data=(\d+) fsdp=(\d+) +([\d.]+) ", line)
    if match:
      held[int(match[2])] = float(match[3])
  count = min(8, len(jax.devices()))
  assert sorted(held) == sorted({1, max(n for n in (1, 2, 4, 8) if n <= count)})
  # Parameters and Adam moments are cut over fsdp: at most the replicated leftovers (biases,
  # norm scales of widths fsdp does not divide) above 1/fsdp of the whole.
  for n, mib in held.items():
    assert held[1] / n <= mib < held[1] / n + 0.02 * held[1]
  # The families of ssmkit.pretrained, built as load builds them, compile for the same mesh.
  assert re.search(r"\nQwen3-Next +[\d,]+ +[\d.]+ ", out) and re.search(r"\nNemotron-H +[\d,]+ ", out)
  assert cli.main([*args, "--configs", "lm_gru"]) == 2
  assert "`--configs` ['lm_gru'] are not shipped lm configs" in capsys.readouterr().err


def _fake_benchmark(seconds_per_shape):
  """A registered benchmark module whose shapes each take `seconds_per_shape`."""
  module = types.ModuleType("fake_benchmark")

  def run(*, shapes, repeats, markdown):
    table = _timing.StreamedTable(("shape", "ms"), [["a", "b", "c"]], markdown=markdown)
    for shape in _timing.within_budget(["a", "b", "c"], "fake"):
      time.sleep(seconds_per_shape)
      table.add([(shape, "1.00")])
    return 0

  module.run = run
  return module


def test_bench_all_runs_every_registered_benchmark_into_one_report(capsys, monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "fake_benchmark", _fake_benchmark(0.0))
  monkeypatch.setattr(cli, "_BENCHMARKS", {"fake": ("fake_benchmark", "a fake"),
                                           "other": ("fake_benchmark", "another")})
  report = tmp_path / "report.md"
  args = ["bench", "all", "--shapes", "small", "--markdown", "--output", str(report)]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert report.read_text() == out
  for text in ("## fake", "## other", "| c     |", "## Summary"):
    assert text in out
  assert "Skipped" not in out


def test_bench_all_skips_what_the_budget_leaves_no_time_for(capsys, monkeypatch, tmp_path):
  # Shapes of 0.2 s in a budget of 0.3 s: each benchmark runs its first shape while time
  # is left, then the rest would not fit.
  monkeypatch.setitem(sys.modules, "fake_benchmark", _fake_benchmark(0.2))
  monkeypatch.setattr(cli, "_BENCHMARKS", {"fake": ("fake_benchmark", "a fake")})
  report = tmp_path / "report.txt"
  assert cli.main(["bench", "all", "--budget-s", "0.3", "--output", str(report)]) == 0
  out = report.read_text()
  rows = [line.split() for line in out.splitlines()]
  assert ["a", "1.00"] in rows and ["b", "1.00"] not in rows
  assert "Skipped to stay within the budget:\n- fake: b\n- fake: c" in out


def test_slow_cells_take_fewer_samples_each_after_a_call_of_its_own():
  calls = []

  def thunk(name, seconds):
    def call():
      calls.append(name)
      time.sleep(seconds)
    return call

  _timing.interleaved_medians({"fast": thunk("fast", 0.0), "slow": thunk("slow", 0.05)},
                              repeats=10, min_sample_s=0.0, cell_budget_s=0.12)
  # Warm-up, estimate, then 10 samples for the fast one and 0.12 / 0.05 -> 2 (1 on a busy
  # machine, where a sleep overruns) for the slow one, each sample behind an untimed call of
  # its own thunk.
  assert calls[:4] == ["fast", "fast", "slow", "slow"]
  pairs = [calls[i:i + 2] for i in range(4, len(calls), 2)]
  assert all(first == second for first, second in pairs), calls
  assert calls.count("fast") == 22 and calls.count("slow") in (4, 6)


def test_bench_linear_attention_small_checks_every_mode_against_lax_scan(capsys):
  status = cli.main(["bench", "linear-attention", "--shapes", "small", "--repeats", "2",
                     "--functions", "linear_attention", "delta_product", "--log-decays", "2", "5"])
  out = capsys.readouterr().out
  assert status == 0
  assert "Log-decays in [-5, -2]." in out
  for name in ("lax.scan", "quadratic", "chunked autodiff", "ssmkit auto", "ssmkit sequential",
               "ssmkit chunked", "ssmkit parallel"):
    assert f" {name} " in out
  for function in ("linear_attention", "delta_product"):
    assert re.search(rf"^{function} +B=2 T=70 H=1 K=V=4 ", out, re.MULTILINE)
  assert not re.search(r"^delta_rule ", out, re.MULTILINE)
  assert "PASS" not in out and "FAIL" not in out and "judged on the full suite only" in out


def test_bench_linear_attention_draws_the_log_decays_asked_for(capsys):
  for function in ("linear_attention", "kda", "mamba3"):
    args, _ = la_bench.inputs(function, la_bench.Shape(2, 9, 2, 3), jax.random.key(0), (2.0, 5.0))
    # Mamba-3 draws its step sizes dt from the range; its log-decays are -a dt.
    drawn = np.asarray(args[4]) if function == "mamba3" else -np.asarray(args[3])
    assert np.all((drawn >= 2.0) & (drawn <= 5.0)), function
  assert cli.main(["bench", "linear-attention", "--shapes", "small", "--log-decays", "5", "2"]) == 2
  assert "needs LO <= HI, got 5 2" in capsys.readouterr().err


@pytest.mark.parametrize("function", la_bench.FUNCTIONS)
def test_bench_linear_attention_baselines_compute_each_function(function):
  """Each function's hand-written lax.scan equals ssmkit's on the bench's own inputs."""
  args, _ = la_bench.inputs(function, la_bench.Shape(1, 6, 2, 3), jax.random.key(0))
  methods = la_bench._methods(function, la_bench.Shape(1, 6, 2, 3))
  np.testing.assert_allclose(methods["lax.scan"](*args), methods["ssmkit sequential"](*args),
                             rtol=1e-5, atol=1e-5)


def test_bench_linear_attention_criteria_judge_the_auto_rows(monkeypatch):
  shape, big = la_bench.Shape(2, 4096, 4, 64), la_bench.Shape(1, 16384, 2, 64)
  suite = la_bench.Suite((shape, big), judged=shape, compile_shape=big)

  def row(function, method, forward, gradient, memory, at=shape, compile_s=1.0):
    return la_bench.Result(function, at, method, forward, gradient, memory, compile_s)

  results = [
      row("linear_attention", "lax.scan", 1.0, 100.0, 1000),
      row("linear_attention", "quadratic", 3.0, 300.0, 3000),
      row("linear_attention", "ssmkit auto", 1.1, 9.0, 90),
      row("delta_rule", "lax.scan", 1.0, 100.0, 1000),
      row("delta_rule", "ssmkit auto", 1.02, 25.0, 50),
      row("kda", "lax.scan", 1.0, 100.0, 1000),
      row("kda", "ssmkit auto", 1.0, 19.0, 40),
      row("generalized_delta_rule", "lax.scan", 1.0, 100.0, 1000),
      row("generalized_delta_rule", "ssmkit auto", 1.0, 30.0, 60),
      row("delta_product", "lax.scan", 1.0, 100.0, 1000),
      row("delta_product", "ssmkit auto", 1.0, 20.0, 50),
      row("mamba3", "lax.scan", 1.0, 100.0, 1000),
      row("mamba3", "ssmkit auto", 1.0, 10.0, 51),
      row("linear_attention", "lax.scan", 1.0, 1.0, 1, at=big, compile_s=2.0),
      row("linear_attention", "ssmkit auto", 0.9, 1.0, 1, at=big, compile_s=7.0),
  ]
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  verdicts = [passed for passed, _ in la_bench.criteria(results, suite)]
  assert verdicts == [
      True, True, False, True, True,  # fwd 1.1x the best; 11.1x faster; 0.25x; 0.09x, 0.05x
      True, True, False, False, True, True,  # kda 5.3x, 0.04x; dplr 3.3x, 0.06x; product 5x, 0.05x
      True, False,  # mamba3 10x, 0.051x
      False, True, True,  # auto fwd over lax.scan's: 1.1x, 1.02x, 0.9x
      False,  # compile 3.5x
  ]


def test_bench_layers_times_one_model_through_both_front_ends():
  results = layers_bench._bench_front_ends(layers_bench.Shape(2, 5, 4), 1, 1, jax.random.key(0))
  assert [r.front_end for r in results] == list(layers_bench.FRONT_ENDS)
  assert all(r.forward_s > 0 and r.backward_s > 0 for r in results)
  table = layers_bench._front_end_table(results, markdown=True)
  assert "| linen (jax.jit) " in table and "| nnx (nnx.jit) " in table and "1.00 |" in table

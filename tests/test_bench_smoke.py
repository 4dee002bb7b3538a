"""Every `ssmkit bench` runs end to end with `--shapes small` and prints its whole table."""

import jax

from ssmkit import cli

METHODS = (
    "lax.scan",
    "lax.associative_scan",
    "ssmkit auto",
    "ssmkit sequential",
    "ssmkit parallel",
    "ssmkit chunked/seq",
    "ssmkit chunked/par",
)


def test_bench_scan_small_prints_every_method_shape_criterion_and_the_split(capsys):
  status = cli.main(["bench", "scan", "--shapes", "small", "--repeats", "2"])
  out = capsys.readouterr().out
  assert status == 0
  for name in METHODS:
    assert f" {name} " in out
  for shape in ("T=64 D=2", "B=2 T=16 D=2"):
    assert shape in out
  # Microsecond timings judge nothing: the criteria are left to the full suite.
  assert "PASS" not in out and "FAIL" not in out and "judged on the full suite only" in out
  # The sequence-parallel table follows, the split checked against one device; with one
  # device (one GPU) a line that says what it needs instead.
  split = out[out.index("Sequence parallelism:"):]
  devices = jax.devices()
  if len(devices) < 2:
    assert "needs at least 2 devices, found 1" in split
    return
  for text in (" one device ", f" sequence-parallel x{len(devices)} ", "T=64 D=2"):
    assert text in split
  # Host devices share the machine's cores: the bench says its times are no speed claim.
  assert ("not a speed claim" in split) == (devices[0].platform == "cpu")


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
  status = cli.main(["bench", "layers", "--shapes", "small", "--repeats", "2"])
  out = capsys.readouterr().out
  assert status == 0
  assert "LRU " in out
  for name in (" sequential ", " parallel ", "unrolled", "nn.scan"):
    assert name in out


def test_bench_layers_runs_only_the_layers_asked_for(capsys):
  status = cli.main(["bench", "layers", "--shapes", "small", "--repeats", "2", "--layers", "Mamba"])
  out = capsys.readouterr().out
  assert status == 0
  assert "Mamba " in out and "LRU " not in out
  assert "nn.scan" not in out  # the depth sweep builds LRU models: skipped without LRU
  assert cli.main(["bench", "layers", "--shapes", "small", "--layers", "GRU"]) == 2
  assert "unknown layer(s) GRU" in capsys.readouterr().err


def test_bench_sequence_parallel_on_one_device_says_how_to_get_more(capsys, monkeypatch):
  first = jax.devices()[:1]
  monkeypatch.setattr(jax, "devices", lambda *args: first)
  assert cli.main(["bench", "sequence-parallel", "--shapes", "small"]) == 0
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in capsys.readouterr().out

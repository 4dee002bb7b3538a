"""The `ssmkit` command line.

    ssmkit bench {scan,rl} [--shapes small|full] [--repeats N] [--markdown]

Each command is a subparser whose `run` default unpacks the parsed flags into a
library call; a new command (`train`, ...) adds one subparser.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence


def _positive_int(text: str) -> int:
  value = int(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


_BENCHMARKS = {
    "scan": ("ssmkit.bench.scan", "linear_recurrence against lax.scan and lax.associative_scan"),
    "rl": ("ssmkit.bench.rl", "ssmkit.rl return estimators against jit(vmap(rlax)); needs rlax"),
}


def _run_benchmark(args: argparse.Namespace) -> int:
  # Imported on use: `bench rl` needs rlax, which the other commands do not.
  module = importlib.import_module(_BENCHMARKS[args.benchmark][0])
  return module.run(shapes=args.shapes, repeats=args.repeats, markdown=args.markdown)


def _add_benchmarks(bench: argparse.ArgumentParser) -> None:
  benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
  for name, (_, text) in _BENCHMARKS.items():
    parser = benchmarks.add_parser(name, help=text, description=text)
    parser.add_argument(
        "--shapes",
        choices=("full", "small"),
        default="full",
        help="'full' (minutes) or 'small' (seconds, for tests); default: full",
    )
    parser.add_argument(
        "--repeats", type=_positive_int, default=10, help="timed samples per cell; default: 10"
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.set_defaults(run=_run_benchmark)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="ssmkit", description="ssmkit command line.")
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  _add_benchmarks(commands.add_parser("bench", help="run a benchmark and print its table"))
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `argv` (default: `sys.argv[1:]`) and runs the command it names.

  Returns:
    The exit status.
  """
  args = _parser().parse_args(argv)
  return args.run(args)

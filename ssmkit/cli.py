"""The `ssmkit` command line.

    ssmkit bench scan [--shapes small|full] [--repeats N] [--markdown]

Each command is a subparser whose `run` default unpacks the parsed flags into a
library call; a new command (`bench rl`, `train`, ...) adds one subparser.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ssmkit.bench import scan as bench_scan


def _positive_int(text: str) -> int:
  value = int(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def _add_bench_scan(benchmarks: argparse._SubParsersAction) -> None:
  parser = benchmarks.add_parser(
      "scan",
      help="linear_recurrence against lax.scan and lax.associative_scan",
      description=bench_scan.__doc__.splitlines()[0],
  )
  parser.add_argument(
      "--shapes",
      choices=tuple(bench_scan.SUITES),
      default="full",
      help="'full' (minutes) or 'small' (seconds, for tests); default: full",
  )
  parser.add_argument(
      "--repeats", type=_positive_int, default=10, help="timed samples per cell; default: 10"
  )
  parser.add_argument("--markdown", action="store_true", help="print a markdown table")
  parser.set_defaults(
      run=lambda args: bench_scan.run(
          shapes=args.shapes, repeats=args.repeats, markdown=args.markdown
      )
  )


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="ssmkit", description="ssmkit command line.")
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  bench = commands.add_parser("bench", help="run a benchmark and print its table")
  benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
  _add_bench_scan(benchmarks)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `argv` (default: `sys.argv[1:]`) and runs the command it names.

  Returns:
    The exit status.
  """
  args = _parser().parse_args(argv)
  return args.run(args)

"""The `ssmkit` command line.

    ssmkit bench {scan,rl,layers,sequence-parallel,linear-attention}
        [--shapes small|full] [--repeats N] [--markdown]   (layers: also --shapes long)
    ssmkit bench all [--shapes small|full] [--repeats N] [--markdown] [--budget-s S] [--output FILE]
    ssmkit train CONFIG [--workdir DIR] [--distributed ...] [key=value ...]   (any task kind)
    ssmkit eval --workdir DIR [--step N]
    ssmkit generate (--workdir DIR | --pretrained DIR_OR_ID) [--prompt TEXT] [--max-tokens N] ...
    ssmkit export --workdir DIR [--step N] [--dtype D] [--max-shard-size S] OUTPUT
    ssmkit configs
    ssmkit --version

Each command is a subparser whose `run` default unpacks the parsed flags into a
library call; a new command (`train`, ...) adds one subparser.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import signal
import sys
from collections.abc import Sequence

import ssmkit


def _positive_int(text: str) -> int:
  value = int(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


# `transformers`' units of `max_shard_size`: decimal, and binary with an "i".
_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _byte_size(text: str) -> int:
  """A positive number of bytes, as `save_pretrained`'s `max_shard_size` takes it: "5GB",
  "500MB", "2GiB" or a plain count."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
  size = match and int(float(match[1]) * _BYTE_UNITS[(match[2] or "B").upper()])
  if not size:
    raise argparse.ArgumentTypeError(
        f"must be a positive size such as 5GB, 500MB or 2GiB, got {text!r}")
  return size


_BENCHMARKS = {
    "scan": ("ssmkit.bench.scan", "linear_recurrence against lax.scan and lax.associative_scan"),
    "rl": ("ssmkit.bench.rl", "ssmkit.rl return estimators against jit(vmap(rlax)); needs rlax"),
    "layers": ("ssmkit.bench.layers", "every SSM layer per mode, and a deep model unrolled or scanned"),
    "sequence-parallel": ("ssmkit.bench.sequence_parallel", "linear_recurrence over time-split devices"),
    "linear-attention": (
        "ssmkit.bench.linear_attention",
        "the matrix-state recurrences per mode against lax.scan (and quadratic attention)",
    ),
    "training": (
        "ssmkit.bench.training",
        "one optimizer step of each lm config, and a 1B model's memory per device under fsdp",
    ),
}


def _run_benchmark(args: argparse.Namespace) -> int:
  # Imported on use: `bench rl` needs rlax, which the other commands do not.
  module = importlib.import_module(_BENCHMARKS[args.benchmark][0])
  options = {"layers": args.layers} if args.benchmark in ("layers", "sequence-parallel") else {}
  if args.benchmark == "training":
    options = {"configs": args.configs}
  if args.benchmark == "linear-attention":
    options = {"functions": args.functions}
    if args.log_decays is not None:
      options["log_decays"] = tuple(args.log_decays)
  return module.run(shapes=args.shapes, repeats=args.repeats, markdown=args.markdown, **options)


def _run_all(args: argparse.Namespace) -> int:
  from ssmkit.bench import report

  output = args.output or pathlib.Path("bench-report.md" if args.markdown else "bench-report.txt")
  return report.run_all({name: module for name, (module, _) in _BENCHMARKS.items()},
                        shapes=args.shapes, repeats=args.repeats, markdown=args.markdown,
                        budget_s=args.budget_s, output=output)


def _positive_float(text: str) -> float:
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
  return value


def _add_common_bench_flags(parser: argparse.ArgumentParser, long: bool = False) -> None:
  parser.add_argument(
      "--shapes",
      choices=("full", "small", "long") if long else ("full", "small"),
      default="full",
      help="'full' (minutes) or 'small' (seconds, for tests)"
      + ("; 'long': one sequence of 4096 and of 16384 steps" if long else "") + "; default: full",
  )
  parser.add_argument(
      "--repeats", type=_positive_int, default=10, help="timed samples per cell; default: 10"
  )
  parser.add_argument("--markdown", action="store_true", help="print markdown tables")


def _add_benchmarks(bench: argparse.ArgumentParser) -> None:
  benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
  for name, (_, text) in _BENCHMARKS.items():
    parser = benchmarks.add_parser(name, help=text, description=text)
    _add_common_bench_flags(parser, long=name == "layers")
    if name in ("layers", "sequence-parallel"):
      parser.add_argument(
          "--layers", nargs="+", metavar="LAYER",
          help="only these layers, by class name (LRU, Mamba2, GatedDeltaNet, ...)"
          + ("; the depth sweep runs when LRU is among them" if name == "layers" else "")
          + "; default: every layer of the suite",
      )
    if name == "linear-attention":
      from ssmkit.bench.linear_attention import FUNCTIONS

      parser.add_argument(
          "--functions", nargs="+", choices=FUNCTIONS, metavar="FUNCTION",
          help=f"only these ({', '.join(FUNCTIONS)}); the criteria are judged when all run; "
          "default: every one",
      )
      parser.add_argument(
          "--log-decays", nargs=2, type=_positive_float, default=None, metavar=("LO", "HI"),
          help="draw the log-decays from [-HI, -LO] (mamba3's step sizes from [LO, HI]); the "
               "criteria are judged at the default, 0.01 0.3",
      )
    if name == "training":
      parser.add_argument(
          "--configs", nargs="+", metavar="CONFIG",
          help="only these shipped lm configs in the throughput table; default: every one",
      )
    parser.set_defaults(run=_run_benchmark)
  text = (f"every benchmark above ({', '.join(_BENCHMARKS)}) in one run: each table printed as "
          "it finishes, all of them written to one report")
  parser = benchmarks.add_parser("all", help=text, description=text)
  _add_common_bench_flags(parser)
  parser.add_argument(
      "--budget-s", type=_positive_float, default=None, metavar="S",
      help="seconds the run may take: a shape starts only while the time left is at least the "
           "longest shape of its benchmark so far; the report lists what was skipped; "
           "default: no limit",
  )
  parser.add_argument(
      "--output", type=pathlib.Path, default=None, metavar="FILE",
      help="the report; default: bench-report.md (with --markdown) or bench-report.txt",
  )
  parser.set_defaults(run=_run_all)


def _run_train(args: argparse.Namespace) -> int:
  # Imported on use: training needs the `train` extra, which the other commands do not.
  from ssmkit import train

  workdir = args.workdir or pathlib.Path("workdirs") / pathlib.Path(args.config).stem
  try:
    if args.distributed or {args.coordinator_address, args.num_processes, args.process_id} != {None}:
      train.core.initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    config = train.load_config(args.config, args.overrides)
    summary = train.train_and_evaluate(config, workdir)
  except (train.ConfigError, FileNotFoundError) as error:
    print(f"ssmkit train: error: {error}", file=sys.stderr)
    return 2
  except train.Interrupted as error:
    print(f"ssmkit train: {error}", file=sys.stderr)
    return 128 + signal.Signals[error.signal_name].value
  metric = train.core.task_kind(config).metric
  print(f"workdir={workdir}")
  print(f"{metric}={_number(summary[metric])}")
  return 0


def _number(value: float | None) -> str:
  """`value` with 4 decimals; "nan" for None (a PPO evaluation in which no episode ended)."""
  return "nan" if value is None else f"{value:.4f}"


def _run_eval(args: argparse.Namespace) -> int:
  from ssmkit import train

  try:
    metric = train.core.workdir_task(args.workdir).metric
    result = train.evaluate(args.workdir, args.step)
  except (FileNotFoundError, train.ConfigError) as error:
    print(f"ssmkit eval: error: {error}", file=sys.stderr)
    return 2
  counts = " ".join(f"{key}={value if isinstance(value, int) else _number(value)}"
                    for key, value in result.items() if key != metric)
  print(counts)
  print(f"{metric}={_number(result[metric])}")
  return 0


def _run_generate(args: argparse.Namespace) -> int:
  import jax

  sampling = dict(rng=jax.random.key(args.seed), temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p)
  try:
    if args.pretrained is not None:
      from ssmkit import pretrained

      # Scanned: decoding compiles one period of blocks, not every layer (docs/pretrained.md).
      model, variables, _ = pretrained.load(args.pretrained, scan_blocks=True)
      print(pretrained.complete(model, variables, pretrained.tokenizer(args.pretrained), args.prompt,
                                args.max_tokens, **sampling))
      return 0
    from ssmkit import train

    kind = train.core.workdir_task(args.workdir).name
    if kind != "lm":
      raise train.ConfigError(f"{args.workdir} holds a `task: {kind}` run; `ssmkit generate` "
                              "continues text with the model of a `task: lm` run.")
    model, variables, config = train.load(args.workdir, args.step)
    text = train.lm.complete(model, variables, args.prompt, args.max_tokens,
                             tokenizer=train.lm.tokenizer(config), **sampling)
  except (FileNotFoundError, ValueError) as error:  # ConfigError and CheckpointError included
    print(f"ssmkit generate: error: {error}", file=sys.stderr)
    return 2
  print(text)
  return 0


def _add_generate(parser: argparse.ArgumentParser) -> None:
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", type=pathlib.Path, help="the workdir of a `task: lm` run")
  source.add_argument("--pretrained", metavar="DIR_OR_ID",
                      help="a Hugging Face checkpoint: a directory, or a hub id (needs the hub "
                           "extra and a network); its tokenizer.json turns text into tokens")
  parser.add_argument("--prompt", default="", help="the start of the text; default: none")
  parser.add_argument("--max-tokens", type=_positive_int, default=256,
                      help="at most this many tokens (bytes for a byte-level run) are written; "
                           "default: 256")
  parser.add_argument("--temperature", type=float, default=0.8,
                      help="softmax temperature, 0 for greedy; default: 0.8")
  parser.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k likeliest")
  parser.add_argument("--top-p", type=float, default=None, help="sample within this nucleus mass")
  parser.add_argument("--seed", type=int, default=0, help="seed of the sampling; default: 0")
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint's step (with --workdir); default: the latest")
  parser.set_defaults(run=_run_generate)


def _run_export(args: argparse.Namespace) -> int:
  from ssmkit import pretrained, train

  try:
    kind = train.core.workdir_task(args.workdir).name
    if kind != "lm":
      raise train.ConfigError(f"{args.workdir} holds a `task: {kind}` run; `ssmkit export` writes "
                              "the language model of a `task: lm` run.")
    model, variables, config = train.load(args.workdir, args.step)
    folder = pretrained.save(model, variables, args.output,
                             source=config.model.pretrained or config.data.tokenizer,
                             dtype=args.dtype, **({} if args.max_shard_size is None
                                                  else {"shard_bytes": args.max_shard_size}))
  except (FileNotFoundError, ValueError) as error:  # ConfigError and CheckpointError included
    print(f"ssmkit export: error: {error}", file=sys.stderr)
    return 2
  print(f"wrote {folder}")
  return 0


def _add_export(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--workdir", type=pathlib.Path, required=True,
                      help="the workdir of a `task: lm` run")
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint's step; default: the latest")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="the tensors' dtype (bfloat16: half the size, rounded to nearest); "
                      "default: float32, which loads back bit for bit")
  parser.add_argument("--max-shard-size", type=_byte_size, default=None,
                      help="the most bytes of tensors in one file, as transformers' "
                      "max_shard_size (5GB, 500MB, 2GiB); past it the checkpoint is written in "
                      "shards with an index; default: 5GB")
  parser.add_argument("output", type=pathlib.Path, help="the folder to write")
  parser.set_defaults(run=_run_export)


def _run_configs(args: argparse.Namespace) -> int:
  del args
  from ssmkit import train

  names = train.shipped_configs()
  width = max(map(len, names))
  for task in train.core.TASKS:
    for name in train.shipped_configs(task):
      print(f"{name:<{width}}  {task:<10}  {train.core.describe_config(name)}")
  return 0


def _add_train(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "config", help="a YAML file, or the name of a config shipped with ssmkit (e.g. mnist1d_lru)"
  )
  parser.add_argument(
      "--workdir", type=pathlib.Path, default=None,
      help="directory of checkpoints, metrics and summary; rerunning resumes there; "
           "default: workdirs/<config name>",
  )
  distributed = parser.add_argument_group(
      "multi-process runs",
      "Every process of the run gets the same command, with its own --process-id; the config's "
      "`mesh` section then spans the devices of all processes. A flag left out comes from "
      "SSMKIT_COORDINATOR_ADDRESS, SSMKIT_NUM_PROCESSES or SSMKIT_PROCESS_ID, else JAX detects it "
      "on Slurm, Open MPI, Kubernetes and Cloud TPU.",
  )
  distributed.add_argument(
      "--distributed", action="store_true",
      help="join a multi-process run (implied by any of the flags below)",
  )
  distributed.add_argument("--coordinator-address", metavar="HOST:PORT",
                           help="address of process 0, reachable from every process")
  distributed.add_argument("--num-processes", type=_positive_int, metavar="N",
                           help="number of processes of the run")
  distributed.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N-1")
  parser.add_argument(
      "overrides", nargs="*", default=[], metavar="key=value",
      help="optional config overrides, e.g. train.epochs=5 model.layer_kwargs.d_state=32",
  )
  parser.set_defaults(run=_run_train)


def _add_eval(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--workdir", type=pathlib.Path, required=True, help="the workdir of a training run"
  )
  parser.add_argument(
      "--step", type=int, default=None, help="the checkpoint's step; default: the latest"
  )
  parser.set_defaults(run=_run_eval)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="ssmkit", description="ssmkit command line.")
  parser.add_argument("--version", action="version", version=f"ssmkit {ssmkit.__version__}")
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  _add_benchmarks(commands.add_parser("bench", help="run a benchmark and print its table"))
  _add_train(commands.add_parser(
      "train", help="train a model from a config, resuming in its workdir",
      description="Trains and evaluates a model; prints test_accuracy=... as its last line "
                  "(mean_episode_return=... for a config of `task: ppo`).",
  ))
  _add_eval(commands.add_parser(
      "eval", help="evaluate a checkpoint of a workdir as its run's final evaluation does",
      description="Restores a checkpoint of a training run (the latest unless --step) and evaluates it.",
  ))
  _add_generate(commands.add_parser(
      "generate", help="continue a prompt with the language model of a `task: lm` workdir",
      description="Restores a `task: lm` run's checkpoint and prints the prompt and its "
                  "continuation, which ends at the end-of-document token or --max-tokens.",
  ))
  _add_export(commands.add_parser(
      "export", help="write a `task: lm` run's model as a Hugging Face checkpoint",
      description="Writes a checkpoint of a `task: lm` run (the latest unless --step) as "
                  "config.json and model.safetensors that transformers and `ssmkit generate "
                  "--pretrained` load, with the tokenizer of the run (its model.pretrained "
                  "checkpoint's tokenizer files and generation config, or its data.tokenizer).",
  ))
  commands.add_parser(
      "configs", help="list the configs shipped with ssmkit", description="Lists the shipped configs, "
      "which `ssmkit train NAME` takes in place of a path, with their task kinds.",
  ).set_defaults(run=_run_configs)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `argv` (default: `sys.argv[1:]`) and runs the command it names.

  Returns:
    The exit status.
  """
  parser = _parser()
  # argparse stops filling `overrides` at an option (`train C a=1 --workdir D b=2`), so
  # the overrides after it arrive as unknown arguments.
  args, rest = parser.parse_known_args(argv)
  if rest and (args.command != "train" or any(arg.startswith("-") for arg in rest)):
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  if rest:
    args.overrides = [*args.overrides, *rest]
  return args.run(args)

"""The `lm` task kind: language models on packed documents of text, in bits per byte."""

import json
import math
import pathlib
import re
import shutil
import signal

import jax
import numpy as np
import pytest

import ssmkit.pretrained
import tokenizer_files
from ssmkit import cli, data, train
from ssmkit._src.train.lm import train as lm_train

# A run small enough for the suite: a 1-block Gated DeltaNet of width 8 on a corpus of its own.
TINY = ("data.seq_len=16", "data.batch_size=4", "data.validation_fraction=0.3", "model.features=8",
        "model.num_blocks=1", "model.mlp_expansion=1.0", "optimizer.warmup_steps=0", "train.steps=6",
        "train.log_every=2", "train.eval_every=0", "mesh.data=1")


def _corpus(folder, count=40, seed=0):
  rng = np.random.default_rng(seed)
  folder.mkdir(parents=True, exist_ok=True)
  for i in range(count):
    text = "".join(rng.choice(list("def x():\n  return 1 + é\n"), rng.integers(3, 40)))
    (folder / f"module_{i}.py").write_text(text, encoding="utf-8")
  return folder


def _last_line(text):
  return text.strip().splitlines()[-1]


@pytest.mark.parametrize("name", train.shipped_configs("lm"))
def test_every_shipped_lm_config_loads_and_comments_every_field(name):
  config = train.load_config(name)
  assert isinstance(config, train.lm.LMConfig) and config.model.pooling == "none"
  path = pathlib.Path(train.__file__).parents[1] / "configs" / f"{name}.yaml"
  for line in path.read_text().splitlines():
    key, _, value = line.partition(":")
    if not line.lstrip().startswith("#") and value.split("#")[0].strip():
      assert "#" in value, f"{name}.yaml: field {key.strip()!r} has no comment"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """One tiny run of the shipped config on a corpus of 40 files, through the command line."""
  root = tmp_path_factory.mktemp("lm")
  corpus = _corpus(root / "corpus")
  workdir = root / "run"
  with jax.enable_x64(False):
    status = cli.main(["train", "lm_gated_deltanet", "--workdir", str(workdir),
                       f"data.path={corpus}", *TINY])
  assert status == 0
  return corpus, workdir, json.loads((workdir / "summary.json").read_text())


def test_a_run_reports_bits_per_byte_of_the_held_out_documents(tiny_run, capsys):
  """Bits per byte, recomputed from the trained model and the packed held-out documents."""
  corpus, workdir, summary = tiny_run
  model, variables, config = train.load(workdir)
  assert isinstance(config, train.lm.LMConfig) and summary["steps"] == 6
  ds = data.text(path=str(corpus), seq_len=16, validation_fraction=0.3)
  logits = np.asarray(jax.jit(model.apply)(variables, ds.x_test, None, ds.reset_test), np.float64)
  log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                     keepdims=True)) - logits.max(-1, keepdims=True)
  nats = -np.take_along_axis(log_probs, ds.y_test[..., None], -1).sum()
  text_bytes = sum(len(doc.text.encode()) for doc in data.split_documents(
      data.read_documents(corpus), 0.3)[1])
  # Every byte of the held-out text but the tail the last row cannot hold is a target.
  assert np.sum(ds.y_test < 256) <= text_bytes < np.sum(ds.y_test < 256) + 16
  np.testing.assert_allclose(summary["test_bits_per_byte"],
                             nats / math.log(2) / np.sum(ds.y_test < 256), rtol=1e-4)
  np.testing.assert_allclose(summary["test_perplexity"], math.exp(summary["test_loss"]), rtol=1e-9)
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert all(r["tokens_per_second"] > 0 for r in records if "tokens_per_second" in r)


def test_evaluate_and_the_command_line_give_the_runs_results(tiny_run, capsys):
  _, workdir, summary = tiny_run
  results = train.evaluate(workdir)
  for key in ("test_loss", "test_bits_per_byte"):
    np.testing.assert_allclose(results[key], summary[key], rtol=1e-6)
  assert cli.main(["eval", "--workdir", str(workdir)]) == 0
  assert _last_line(capsys.readouterr().out).startswith("test_bits_per_byte=")


@pytest.mark.parametrize(
    "override, key",
    [
        ("data.path={tmp}/nothing_here", r"`data\.path`"),
        ("data.seq_len=1", r"`data\.seq_len`"),
        ("data.seq_len=100000", r"the train split holds \d+ tokens .* fewer than one row of "
         r"`data\.seq_len`=100000 .* lower `data\.seq_len`"),
        ("data.validation_fraction=1.0", r"`data\.validation_fraction`"),
        ("model.pooling=mean", r"`model\.pooling`"),
        ("data.name=mnist1d", r"`data\.name`"),
        ("samples.documents=-1", r"`samples\.documents` must be >= 0"),
        ("samples.temperature=0", r"`samples\.temperature` must be > 0"),
        ("data.tokenizer={tmp}/missing.json", r"`data\.tokenizer` .*missing.json.* no such file"),
        ("data.eod_token=</s>", r"`data\.eod_token` '</s>' needs a `data\.tokenizer` file"),
    ],
)
def test_bad_lm_configs_are_named_before_anything_is_written(override, key, tmp_path, capsys):
  corpus = _corpus(tmp_path / "corpus", count=10)
  workdir = tmp_path / "run"
  status = cli.main(["train", "lm_gated_deltanet", "--workdir", str(workdir),
                     f"data.path={corpus}", *TINY, override.format(tmp=tmp_path)])
  assert status == 2
  assert re.search(key, capsys.readouterr().err)
  assert not workdir.exists()


def test_text_that_is_not_utf8_is_named(tmp_path, capsys):
  corpus = _corpus(tmp_path / "corpus", count=10)
  (corpus / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
  assert cli.main(["train", "lm_gated_deltanet", "--workdir", str(tmp_path / "run"),
                   f"data.path={corpus}", *TINY]) == 2
  error = capsys.readouterr().err
  assert "`data.path`: " in error and "image.png' is not UTF-8 text" in error


def test_generate_continues_a_prompt_greedily_as_the_model_reads_it(tiny_run, capsys):
  """The command line's greedy text, against the argmax of the whole model re-run on the text so
  far (padded to one length, which a causal model does not see)."""
  _, workdir, _ = tiny_run
  prompt, count = "def x", 12
  assert cli.main(["generate", "--workdir", str(workdir), "--prompt", prompt, "--max-tokens",
                   str(count), "--temperature", "0"]) == 0
  printed = capsys.readouterr().out.rstrip("\n")
  model, variables, _ = train.load(workdir)
  tokens = [256, *prompt.encode()]
  run = jax.jit(lambda t: model.apply(variables, t))
  for _ in range(count):
    padded = np.zeros((1, len(prompt) + 1 + count), np.int32)
    padded[0, :len(tokens)] = tokens
    token = int(np.argmax(run(padded)[0, len(tokens) - 1]))
    if token == 256:
      break
    tokens.append(token)
  assert printed == prompt + data.ByteTokenizer().decode(np.array(tokens[len(prompt) + 1:]))


def test_generate_needs_an_lm_run_and_sound_sampling(tiny_run, tmp_path, capsys):
  _, workdir, _ = tiny_run
  assert cli.main(["generate", "--workdir", str(workdir), "--temperature", "-1"]) == 2
  assert "`temperature` must be >= 0" in capsys.readouterr().err
  (tmp_path / "config.yaml").write_text("task: supervised\ndata:\n  name: mnist1d\n")
  assert cli.main(["generate", "--workdir", str(tmp_path)]) == 2
  assert "holds a `task: supervised` run" in capsys.readouterr().err


def test_an_interrupted_run_resumes_to_the_uninterrupted_one(tiny_run, tmp_path):
  """SIGINT after step 4, then the same call again: the parameters and results of the run that
  was never stopped (same data: the corpus is made from the same seed)."""
  corpus = _corpus(tmp_path / "corpus")
  workdir = tmp_path / "run"
  config = train.load_config("lm_gated_deltanet", [f"data.path={corpus}", *TINY])

  def stop(step):
    if step == 4:
      signal.raise_signal(signal.SIGINT)

  with jax.enable_x64(False):
    with pytest.raises(train.Interrupted):
      train.train_and_evaluate(config, workdir, hooks=[stop])
    summary = train.train_and_evaluate(config, workdir)
  _, whole, expected = tiny_run
  _, resumed, _ = train.load(workdir)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), resumed,
               train.load(whole)[1])
  np.testing.assert_allclose(summary["test_bits_per_byte"], expected["test_bits_per_byte"],
                             rtol=1e-5)


def test_each_evaluation_shows_continuations_of_held_out_documents(tiny_run):
  """The first `samples.prompt_tokens` bytes of the first `samples.documents` held-out documents,
  continued greedily (checked against the argmax of the whole model re-run on the text so far)
  and sampled, each by up to `samples.new_tokens` bytes; `samples.documents=0` shows none."""
  corpus = tiny_run[0]
  shown = ["samples.documents=3", "samples.prompt_tokens=20", "samples.new_tokens=30"]
  config = train.load_config("lm_gated_deltanet", [f"data.path={corpus}", *TINY, *shown])
  run = train.supervised.setup(config, lm_train.TASK)
  lines = lm_train.samples(config, run, run.state)
  held_out = [d.text.encode() for d in data.split_documents(data.read_documents(corpus), 0.3)[1]]
  starts = [text[:20] for text in held_out if len(text) >= 20][:3]
  tokenizer = data.ByteTokenizer()
  assert len(starts) == 3 and [line.split(" -> ")[0] for line in lines] == [
      f"{kind}: {tokenizer.decode(np.frombuffer(start, np.uint8))!r}"
      for kind in ("greedy", "sampled") for start in starts]
  apply = jax.jit(lambda tokens: run.model.apply({"params": run.state.params}, tokens))
  for line, start in zip(lines[:3], starts, strict=True):
    tokens = [256, *start]
    while len(tokens) < 1 + 20 + 30:
      padded = np.zeros((1, 1 + 20 + 30), np.int32)
      padded[0, :len(tokens)] = tokens
      token = int(np.argmax(apply(padded)[0, len(tokens) - 1]))
      if token == 256:
        break
      tokens.append(token)
    assert line.split(" -> ")[1] == repr(tokenizer.decode(np.array(tokens[21:])))
  none = train.load_config("lm_gated_deltanet", [f"data.path={corpus}", *TINY, "samples.documents=0"])
  assert lm_train.samples(none, run, run.state) == []


def test_a_run_with_a_tokenizer_file_reports_bits_per_byte_of_text(tmp_path, capsys):
  """A byte-level BPE's run: bits per byte are its summed loss over the bytes of held-out text
  behind its targets; `generate` writes with the run's tokenizer, and another vocabulary is named."""
  corpus = _corpus(tmp_path / "corpus")
  documents = data.read_documents(corpus)
  path = tokenizer_files.byte_level_bpe(tmp_path / "tokenizer.json", [d.text for d in documents])
  workdir = tmp_path / "run"
  with jax.enable_x64(False):
    assert cli.main(["train", "lm_gated_deltanet", "--workdir", str(workdir), f"data.path={corpus}",
                     f"data.tokenizer={path}", *TINY]) == 0
  summary = json.loads((workdir / "summary.json").read_text())
  model, variables, config = train.load(workdir)
  ds = data.text(path=str(corpus), seq_len=16, validation_fraction=0.3, tokenizer=str(path))
  assert model.vocab_size == ds.vocab_size == 300
  log_probs = np.asarray(jax.nn.log_softmax(
      np.asarray(jax.jit(model.apply)(variables, ds.x_test, None, ds.reset_test), np.float64)))
  nats = -np.take_along_axis(log_probs, ds.y_test[..., None], -1).sum()
  held_out = data.split_documents(documents, 0.3)[1]
  # The tokens cover nearly all held-out bytes (all but the tail the last row drops).
  assert 0.9 * sum(len(d.text.encode()) for d in held_out) < ds.target_bytes_test.sum()
  np.testing.assert_allclose(summary["test_bits_per_byte"],
                             nats / math.log(2) / ds.target_bytes_test.sum(), rtol=1e-4)
  capsys.readouterr()
  assert cli.main(["generate", "--workdir", str(workdir), "--prompt", "def x", "--max-tokens", "4",
                   "--temperature", "0"]) == 0
  printed = capsys.readouterr().out.rstrip("\n")
  written = train.lm.complete(model, variables, "def x", 4, tokenizer=train.lm.tokenizer(config))
  assert printed == written and written.startswith("def x")
  with pytest.raises(ValueError, match=r"`tokenizer` has 257 tokens, but the model reads 300"):
    train.lm.complete(model, variables, "def x", 4)


PRETRAINED = pathlib.Path(__file__).parent / "fixtures" / "pretrained" / "mamba"


def test_a_run_fine_tunes_a_published_checkpoint(tmp_path, capsys):
  """`model.pretrained`: the checkpoint's model and weights at step 0, its tokenizer.json for
  the text, then training, evaluation and `generate` as for any run; evaluating and resuming
  the run need no more than the published config.json (its weights are not read again)."""
  published = shutil.copytree(PRETRAINED, tmp_path / "published")
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(4)
  for i in range(30):
    words = " ".join(f"t{w}" for w in rng.integers(3, 96, rng.integers(5, 40)))
    (corpus / f"doc{i}.txt").write_text(words, encoding="utf-8")
  # The checkpoint replaces the `model` section's architecture: TINY's model fields would be
  # refused.
  overrides = [f"model.pretrained={published}", f"data.path={corpus}",
               *(option for option in TINY if not option.startswith("model."))]
  config = train.load_config("lm_mamba", overrides)
  with jax.enable_x64(False):
    run = train.supervised.setup(config, lm_train.TASK)
    _, variables, _ = ssmkit.pretrained.load(PRETRAINED)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(run.state.params), variables["params"])
    assert run.layer_kinds == ("mamba",) and run.dataset.vocab_size == 96
    workdir = tmp_path / "run"
    assert cli.main(["train", "lm_mamba", "--workdir", str(workdir), *overrides]) == 0
  out = capsys.readouterr().out
  assert "mamba model with" in out and _last_line(out).startswith("test_bits_per_byte=")
  (published / "model.safetensors").unlink()
  loss = json.loads((workdir / "summary.json").read_text())["test_loss"]
  np.testing.assert_allclose(train.evaluate(workdir)["test_loss"], loss, rtol=1e-6)
  with jax.enable_x64(False):  # resumed at its last step: restored and evaluated again
    assert cli.main(["train", "lm_mamba", "--workdir", str(workdir), *overrides]) == 0
  np.testing.assert_allclose(json.loads((workdir / "summary.json").read_text())["test_loss"], loss,
                             rtol=1e-6)
  capsys.readouterr()
  assert cli.main(["generate", "--workdir", str(workdir), "--prompt", "t5 t9", "--max-tokens", "4",
                   "--temperature", "0"]) == 0
  # Prompt and continuation decoded as one sequence: the word-level tokenizer's words apart.
  words = capsys.readouterr().out.split()
  assert words[:2] == ["t5", "t9"] and len(words) > 2, words
  assert all(re.fullmatch(r"t\d+", word) for word in words), words
  assert cli.main(["train", "lm_mamba", "--workdir", str(tmp_path / "bad"), *overrides,
                   "data.tokenizer=tokenizer.json"]) == 2
  assert "`data.tokenizer` must be null with `model.pretrained`" in capsys.readouterr().err
  for option in ("model.features=8", "model.layer_kwargs.d_state=4"):
    assert cli.main(["train", "lm_mamba", "--workdir", str(tmp_path / "bad"), *overrides,
                     option]) == 2
    key = option.partition("=")[0]
    assert f"`{key}` cannot be set with `model.pretrained`" in capsys.readouterr().err
  assert cli.main(["train", "lm_mamba", "--workdir", str(tmp_path / "bad"), *overrides,
                   f"model.pretrained={tmp_path / 'nothing'}"]) == 2
  assert "`model.pretrained`: " in capsys.readouterr().err and not (tmp_path / "bad").exists()

"""Text corpora: reading documents, the split by document, byte tokens, packing; and every
registered layer's model on packed rows against each document alone."""

import pathlib
import sysconfig

import jax
import numpy as np
import pytest

import compiled
import registered
from ssmkit import data, layers, train

TOKENIZER = data.ByteTokenizer()


def test_the_default_corpus_is_the_standard_librarys_own_code():
  documents = data.read_documents()
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  names = [d.name for d in documents]
  assert names == sorted(names) and len(set(names)) == len(names) > 500
  assert all(name.endswith(".py") for name in names)
  assert not any({"site-packages", "test", "tests"} & set(name.split("/")) for name in names)
  by_name = {d.name: d.text for d in documents}
  assert by_name["json/decoder.py"] == (root / "json" / "decoder.py").read_text(encoding="utf-8")


def _write(folder, files):
  for name, content in files.items():
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


def test_a_file_a_folder_and_a_glob(tmp_path):
  _write(tmp_path, {"a.txt": "alpha", "sub/b.txt": "béta ✓", "sub/d.md": "# delta", "c.txt": ""})
  folder = data.read_documents(tmp_path)
  assert [(d.name, d.text) for d in folder] == [("a.txt", "alpha"), ("sub/b.txt", "béta ✓"),
                                                ("sub/d.md", "# delta")]
  assert [d.name for d in data.read_documents(f"{tmp_path}/**/*.txt")] == ["a.txt", "sub/b.txt"]
  assert [(d.name, d.text) for d in data.read_documents(tmp_path / "sub" / "b.txt")] == [
      ("b.txt", "béta ✓")]


def test_paths_without_text_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"`path` .*nothing_here.* neither a file, a folder nor a glob"):
    data.read_documents(tmp_path / "nothing_here")
  _write(tmp_path / "empty", {"a.txt": "", "b/c.txt": ""})
  with pytest.raises(ValueError, match=r"`path` .* holds no text: its 2 file"):
    data.read_documents(tmp_path / "empty")
  _write(tmp_path / "mixed", {"a.txt": "fine", "b.bin": b"\xff\xfe\x00binary"})
  with pytest.raises(ValueError, match=r"`path`: .*b\.bin' is not UTF-8 text"):
    data.read_documents(tmp_path / "mixed")


def test_the_split_is_by_document_name_alone():
  documents = data.read_documents()
  train, validation = data.split_documents(documents, 0.05)
  assert sorted(d.name for d in train + validation) == [d.name for d in documents]
  assert not {d.name for d in train} & {d.name for d in validation}
  # The same documents in another order, or fewer of them, keep their split.
  order = np.random.default_rng(0).permutation(len(documents))
  shuffled = data.split_documents([documents[i] for i in order], 0.05)
  assert {d.name for d in shuffled[1]} == {d.name for d in validation}
  half = {d.name for d in data.split_documents(documents[::2], 0.05)[1]}
  assert half == {d.name for d in validation} & {d.name for d in documents[::2]}
  # A hash is near uniform: about 5% of ~730 documents, and more with a larger fraction.
  assert 0.02 < len(validation) / len(documents) < 0.09
  wider = {d.name for d in data.split_documents(documents, 0.2)[1]}
  assert {d.name for d in validation} < wider


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5])
def test_a_split_fraction_outside_zero_to_one_is_named(fraction):
  with pytest.raises(ValueError, match="`validation_fraction`"):
    data.split_documents(data.read_documents(), fraction)


def test_a_split_that_leaves_one_side_empty_is_named():
  with pytest.raises(ValueError, match=r"`validation_fraction`=0\.05 leaves the .* split of 1 document"):
    data.split_documents([data.Document("only.txt", "text")], 0.05)


def test_bytes_round_trip_and_the_end_token_stays_apart():
  text = "héllo → ✓ 🐍\n\tend"
  tokens = TOKENIZER.encode(text)
  assert tokens.dtype == np.int32 and list(tokens) == list(text.encode("utf-8"))
  assert TOKENIZER.decode(tokens) == text
  assert TOKENIZER.decode(np.concatenate([[256], tokens, [256]])) == text
  assert TOKENIZER.decode(tokens[:-len("🐍\n\tend".encode()) + 1]) == "héllo → ✓ \ufffd"
  assert (TOKENIZER.vocab_size, TOKENIZER.eod) == (257, 256) and tokens.max() < 256


def _pack_reference(documents, seq_len, eod):
  """Packing written out step by step, from its definition."""
  stream, starts = [], []
  for document in documents:
    starts.append(True)
    stream.append(eod)
    for token in document:
      starts.append(False)
      stream.append(int(token))
  rows = (len(stream) - 1) // seq_len
  inputs = [[stream[r * seq_len + t] for t in range(seq_len)] for r in range(rows)]
  targets = [[stream[r * seq_len + t + 1] for t in range(seq_len)] for r in range(rows)]
  reset = [[starts[r * seq_len + t] for t in range(seq_len)] for r in range(rows)]
  return np.array(inputs), np.array(targets), np.array(reset, bool)


@pytest.mark.parametrize("seq_len", [2, 3, 7, 16])
def test_packing_matches_its_definition(seq_len):
  rng = np.random.default_rng(seq_len)
  documents = [rng.integers(0, 256, n) for n in (5, 1, 0, 13, 2, 8)]
  packed = data.pack_documents(documents, seq_len, 256)
  for got, want in zip((packed.inputs, packed.targets, packed.reset),
                       _pack_reference(documents, seq_len, 256), strict=True):
    np.testing.assert_array_equal(got, want)
  assert packed.inputs.dtype == packed.targets.dtype == np.int32


def test_packing_refuses_rows_it_cannot_fill():
  with pytest.raises(ValueError, match="`seq_len` must be >= 2"):
    data.pack_documents([np.arange(10)], 1, 256)
  with pytest.raises(ValueError, match="`seq_len`=11 is longer than the 11 tokens"):
    data.pack_documents([np.arange(10)], 11, 256)


# Documents of 4, 1, 6 and 2 tokens: with their end tokens, one row of 17 steps, whose last
# target is the end token of a fifth document that the row does not reach.
LENGTHS = (4, 1, 6, 2)
ROW = sum(LENGTHS) + len(LENGTHS)


@pytest.mark.parametrize("name", registered.names())
def test_a_packed_row_gives_each_document_what_it_gets_alone(name):
  """Every layer's model: per-step logits (so losses) on one packed row equal each document's
  own, run alone from the zero state; the reset at each end token keeps them apart."""
  model = layers.SequenceModel(num_outputs=257, layer=registered.linen_cases(variants=False)[name],
                               features=8, num_blocks=2, vocab_size=257, pooling="none")
  rng = np.random.default_rng(1)
  documents = [rng.integers(0, 256, n) for n in LENGTHS]
  packed = data.pack_documents([*documents, np.array([7])], ROW, 256)
  assert packed.inputs.shape == (1, ROW)
  variables = compiled.init(model, (1, ROW), 0, "int32")
  logits = np.asarray(compiled.run(model)(variables, packed.inputs, None, packed.reset))[0]
  # Alone: each document [eod, *tokens] in a row of its own, padded at the end (the model is
  # causal, so what follows a document changes nothing of it).
  alone = np.zeros((len(LENGTHS), ROW), np.int32)
  for i, document in enumerate(documents):
    alone[i, :len(document) + 1] = [256, *document]
  separate = np.asarray(compiled.run(model)(variables, alone))
  nll = lambda z, y: -np.asarray(jax.nn.log_softmax(z))[np.arange(len(y)), y].sum()
  start, per_document = 0, 0.0
  for i, n in enumerate(LENGTHS):
    own = separate[i, :n + 1]
    np.testing.assert_allclose(logits[start:start + n + 1], own, rtol=1e-5,
                               atol=1e-5 * np.abs(separate).max())
    per_document += nll(own, [*documents[i], 256])
    start += n + 1
  # So the row's loss is the sum of the documents' own losses.
  np.testing.assert_allclose(nll(logits, packed.targets[0]), per_document, rtol=1e-5)


def test_the_text_dataset_is_the_packed_split_corpus(tmp_path):
  rng = np.random.default_rng(2)
  _write(tmp_path, {f"doc{i}.txt": "".join(rng.choice(list("abc déf\n"), rng.integers(1, 30)))
                    for i in range(40)})
  ds = data.load("text", path=str(tmp_path), seq_len=8, validation_fraction=0.3)
  train, test = data.split_documents(data.read_documents(tmp_path), 0.3)
  for split, documents, x, y, reset in (("train", train, ds.x_train, ds.y_train, ds.reset_train),
                                        ("test", test, ds.x_test, ds.y_test, ds.reset_test)):
    packed = data.pack_documents([TOKENIZER.encode(d.text) for d in documents], 8, 256)
    np.testing.assert_array_equal(x, packed.inputs, err_msg=split)
    np.testing.assert_array_equal(y, packed.targets, err_msg=split)
    np.testing.assert_array_equal(reset, packed.reset, err_msg=split)
  assert (ds.vocab_size, ds.num_classes, ds.per_step) == (257, 257, True)
  with pytest.raises(ValueError, match="`seq_len`"):
    data.load("text", path=str(tmp_path), seq_len=1)


def test_training_on_text_passes_each_document_start_as_a_reset(tmp_path):
  """The run's own test loss is the model's loss with the dataset's resets, not without."""
  corpus = tmp_path / "corpus"
  rng = np.random.default_rng(3)
  _write(corpus, {f"doc{i}.txt": "".join(rng.choice(list("xyz \n"), rng.integers(2, 12)))
                  for i in range(60)})
  kwargs = dict(path=str(corpus), seq_len=16, validation_fraction=0.3)
  config = train.load_config(None, [
      "data.name=text", f"data.kwargs={kwargs}", "data.batch_size=4", "model.pooling=none",
      "model.layer=gated_deltanet", "model.layer_kwargs={num_heads: 2}", "model.features=8",
      "model.num_blocks=1", "train.steps=3", "train.eval_every=0", "mesh.data=1"])
  summary = train.train_and_evaluate(config, tmp_path / "run")
  model, variables, _ = train.load(tmp_path / "run")
  ds = data.text(**kwargs)
  nll = lambda logits: float(np.mean(-np.take_along_axis(
      np.asarray(jax.nn.log_softmax(logits)), ds.y_test[..., None], axis=-1)))
  with_resets = nll(model.apply(variables, ds.x_test, None, ds.reset_test))
  np.testing.assert_allclose(summary["test_loss"], with_resets, rtol=1e-4)
  assert abs(nll(model.apply(variables, ds.x_test)) - with_resets) > 1e-3

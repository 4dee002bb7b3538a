"""Text corpora: reading documents, the split by document, byte tokens, packing; and every
registered layer's model on packed rows against each document alone."""

import hashlib
import pathlib
import sysconfig

import jax
import numpy as np
import pytest

import compiled
import registered
import tokenizer_files
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
  with pytest.raises(ValueError, match=r"`path` .* holds no text: every one of its 2 files is empty"):
    data.read_documents(tmp_path / "empty")
  (tmp_path / "nothing").mkdir()
  with pytest.raises(ValueError, match=r"`path` .* holds no text: it is an empty folder"):
    data.read_documents(tmp_path / "nothing")
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
  documents = [data.Document(f"doc{i}.txt", "text") for i in range(3)]
  with pytest.raises(ValueError, match="`validation_fraction`"):
    data.split_documents(documents, fraction)


def test_a_small_corpus_keeps_a_document_on_each_side_and_one_document_is_named():
  """Three documents and a fraction of 5%: no name hashes below it, so the lowest-hashing one is
  held out, the others train; a tiny fraction leaves training the highest-hashing one."""
  documents = [data.Document(f"doc{i}.txt", "text") for i in range(3)]
  train, validation = data.split_documents(documents, 0.05)
  hashes = sorted(documents, key=lambda d: hashlib.sha256(d.name.encode()).digest())
  assert [d.name for d in validation] == [hashes[0].name] and len(train) == 2
  train, validation = data.split_documents(documents, 0.999999)
  assert [d.name for d in train] == [hashes[-1].name] and len(validation) == 2
  with pytest.raises(ValueError, match=r"`path` holds 1 document, which cannot be split"):
    data.split_documents([data.Document("only.txt", "text")], 0.05)


def test_a_split_shorter_than_one_row_is_named_with_the_keys_to_change(tmp_path):
  _write(tmp_path / "small", {f"doc{i}.txt": "x" * (100 + i) for i in range(3)})
  with pytest.raises(ValueError, match=r"the validation split holds \d+ tokens in 1 document\(s\), "
                     r"fewer than one row of `seq_len`=128 .* lower `seq_len`"):
    data.text(path=str(tmp_path / "small"), seq_len=128)


def test_bytes_round_trip_and_the_end_token_stays_apart():
  text = "héllo → ✓ 🐍\n\tend"
  tokens = TOKENIZER.encode(text)
  assert tokens.dtype == np.int32 and list(tokens) == list(text.encode("utf-8"))
  assert TOKENIZER.decode(tokens) == text
  assert TOKENIZER.decode(np.concatenate([[256], tokens, [256]])) == text
  assert TOKENIZER.decode(tokens[:-len("🐍\n\tend".encode()) + 1]) == "héllo → ✓ \ufffd"
  assert (TOKENIZER.vocab_size, TOKENIZER.eod) == (257, 256) and tokens.max() < 256


TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld → ✓ 🐍\n\tend  ", "class A:\n  pass\n"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE of 300 tokens trained by `tokenizers` on Python-like text."""
  path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
  return tokenizer_files.byte_level_bpe(path, TEXTS * 20)


def test_a_tokenizer_file_encodes_as_tokenizers_does_and_counts_every_byte(bpe):
  from tokenizers import Tokenizer

  own = Tokenizer.from_file(str(bpe))
  coder = data.load_tokenizer(bpe)
  assert (coder.vocab_size, coder.eod) == (300, own.token_to_id("<|endoftext|>"))
  for text in [*TEXTS, "ünïcödé ✓✓ 🐍🐍 ", "x", ""]:
    tokens, counts = coder.encode_counted(text)
    assert tokens.dtype == counts.dtype == np.int32
    np.testing.assert_array_equal(tokens, own.encode(text, add_special_tokens=False).ids)
    np.testing.assert_array_equal(coder.encode(text), tokens)
    assert counts.sum() == len(text.encode()) and (counts >= 0).all()
    assert coder.decode(tokens) == text == coder.decode(np.concatenate([[coder.eod], tokens]))
  # Byte-level tokens of ASCII text spell their bytes one character each.
  tokens, counts = coder.encode_counted(TEXTS[0])
  assert list(counts) == [len(own.id_to_token(int(t))) for t in tokens]


def test_bytes_no_token_keeps_count_in_the_token_before_them(tmp_path):
  coder = data.load_tokenizer(tokenizer_files.stripping_words(tmp_path / "t.json", ["ab", "c"]))
  # No end-of-document name among the tokens: a new token after the last.
  assert (coder.vocab_size, coder.eod) == (4, 3)
  tokens, counts = coder.encode_counted("  ab  c ab\n")
  assert list(tokens) == [1, 2, 1] and list(counts) == [4, 3, 4]


def test_the_end_of_document_token_is_found_or_named(bpe, tmp_path):
  assert data.load_tokenizer(bpe, "<|endoftext|>").eod == data.load_tokenizer(bpe).eod
  path = tokenizer_files.byte_level_bpe(tmp_path / "eos.json", TEXTS, special=("<pad>", "</s>"))
  assert data.load_tokenizer(path).eod == 1
  with pytest.raises(ValueError, match=r"`eod_token` '<eos>' is not a token of"):
    data.load_tokenizer(bpe, "<eos>")
  with pytest.raises(ValueError, match=r"`eod_token` '</s>' needs a `tokenizer` file"):
    data.load_tokenizer(None, "</s>")
  with pytest.raises(ValueError, match=r"`tokenizer` .*missing.json.* no such file"):
    data.load_tokenizer(tmp_path / "missing.json")
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"`tokenizer` .*bad.json.* cannot be read as a tokenizer"):
    data.load_tokenizer(tmp_path / "bad.json")


def _pack_reference(documents, seq_len, eod, text_bytes):
  """Packing written out step by step, from its definition."""
  stream, starts, weights = [], [], []
  for document, counts in zip(documents, text_bytes, strict=True):
    starts.append(True)
    stream.append(eod)
    weights.append(0)
    for token, count in zip(document, counts, strict=True):
      starts.append(False)
      stream.append(int(token))
      weights.append(int(count))
  rows = (len(stream) - 1) // seq_len
  window = lambda values, shift: [[values[r * seq_len + t + shift] for t in range(seq_len)]
                                  for r in range(rows)]
  return (np.array(window(stream, 0)), np.array(window(stream, 1)),
          np.array(window(starts, 0), bool), np.array(window(weights, 1)))


@pytest.mark.parametrize("seq_len", [2, 3, 7, 16])
@pytest.mark.parametrize("counted", [False, True], ids=["bytes", "counted"])
def test_packing_matches_its_definition(seq_len, counted):
  rng = np.random.default_rng(seq_len)
  documents = [rng.integers(0, 256, n) for n in (5, 1, 0, 13, 2, 8)]
  counts = [rng.integers(0, 5, len(d)) for d in documents] if counted else None
  packed = data.pack_documents(documents, seq_len, 256, counts)
  ones = [np.ones(len(d), int) for d in documents]
  for got, want in zip((packed.inputs, packed.targets, packed.reset, packed.target_bytes),
                       _pack_reference(documents, seq_len, 256, counts or ones), strict=True):
    np.testing.assert_array_equal(got, want)
  assert packed.inputs.dtype == packed.targets.dtype == packed.target_bytes.dtype == np.int32


def test_packing_refuses_rows_it_cannot_fill():
  with pytest.raises(ValueError, match="`seq_len` must be >= 2"):
    data.pack_documents([np.arange(10)], 1, 256)
  with pytest.raises(ValueError, match="`seq_len`=11 is longer than the 11 tokens"):
    data.pack_documents([np.arange(10)], 11, 256)
  with pytest.raises(ValueError, match="`text_bytes` must hold one count per token"):
    data.pack_documents([np.arange(10)], 4, 256, [np.ones(9)])


# Documents of 4, 1, 6 and 2 tokens: with their end tokens, one row of 17 steps, whose last
# target is the end token of a fifth document that the row does not reach.
LENGTHS = (4, 1, 6, 2)
ROW = sum(LENGTHS) + len(LENGTHS)


@pytest.mark.parametrize("name", registered.ONE_OF_EACH_STATE)
def test_a_packed_row_gives_each_document_what_it_gets_alone(name):
  """A model of each kind of state: per-step logits (so losses) on one packed row equal each
  document's own, run alone from the zero state; the reset at each end token keeps them apart."""
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


@pytest.mark.parametrize("tokenized", [False, True], ids=["bytes", "tokenizer"])
def test_the_text_dataset_is_the_packed_split_corpus(tmp_path, bpe, tokenized):
  rng = np.random.default_rng(2)
  _write(tmp_path, {f"doc{i}.txt": "".join(rng.choice(list("abc déf✓\n"), rng.integers(1, 30)))
                    for i in range(40)})
  tokenizer = str(bpe) if tokenized else None
  ds = data.load("text", path=str(tmp_path), seq_len=8, validation_fraction=0.3, tokenizer=tokenizer)
  coder = data.load_tokenizer(tokenizer)
  train, test = data.split_documents(data.read_documents(tmp_path), 0.3)
  for split, documents, x, y, reset in (("train", train, ds.x_train, ds.y_train, ds.reset_train),
                                        ("test", test, ds.x_test, ds.y_test, ds.reset_test)):
    encoded = [coder.encode_counted(d.text) for d in documents]
    packed = data.pack_documents([t for t, _ in encoded], 8, coder.eod, [b for _, b in encoded])
    np.testing.assert_array_equal(x, packed.inputs, err_msg=split)
    np.testing.assert_array_equal(y, packed.targets, err_msg=split)
    np.testing.assert_array_equal(reset, packed.reset, err_msg=split)
  np.testing.assert_array_equal(ds.target_bytes_test, packed.target_bytes)
  # Every byte of the held-out text is behind one target, but for the tail the last row drops.
  weights = np.concatenate([np.concatenate([[0], b]) for _, b in encoded])
  assert ds.target_bytes_test.sum() + weights[1 + ds.y_test.size:].sum() == sum(
      len(d.text.encode()) for d in test)
  assert ds.vocab_size == ds.num_classes == coder.vocab_size and ds.per_step
  assert ds.tokenizer == coder if not tokenized else ds.tokenizer.path == bpe
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
  run = jax.jit(model.apply)
  with_resets = nll(run(variables, ds.x_test, None, ds.reset_test))
  np.testing.assert_allclose(summary["test_loss"], with_resets, rtol=1e-4)
  assert abs(nll(run(variables, ds.x_test, None, np.zeros_like(ds.reset_test))) - with_resets) > 1e-3

"""Hugging Face checkpoints loaded by `ssmkit.pretrained`, against `transformers`' own outputs.

The fixtures in tests/fixtures/pretrained were made by `transformers` itself
(scripts/make_pretrained_fixtures.py): tiny random models saved with `save_pretrained`, their
float32 logits and greedy continuations. The suite never imports torch.
"""

import dataclasses
import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx
from safetensors.flax import save_file as save_jax
from safetensors.numpy import load_file, save_file

import compiled
import ssmkit.nnx as snx
import ssmkit.pretrained
from ssmkit import cli, layers, train
from ssmkit._src.pretrained import load as pretrained_load
from ssmkit._src.pretrained import olmo_hybrid, qwen3_5
from ssmkit._src.pretrained.config import Fields
from ssmkit._src.pretrained.files import read_weights
from ssmkit._src.pretrained.save import CARRIED_FIELDS
from ssmkit._src.train.lm import train as lm_train

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "pretrained"
# Each fixture's architecture: "mamba_bias" is a Mamba with projection biases, no convolution
# bias and an untied head.
ARCHITECTURES = {"mamba": "MambaForCausalLM", "mamba_bias": "MambaForCausalLM",
                 "falcon_mamba": "FalconMambaForCausalLM", "mamba2": "Mamba2ForCausalLM",
                 "recurrent_gemma": "RecurrentGemmaForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5": "Qwen3_5ForConditionalGeneration",
                 "qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                 "bamba": "BambaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                 "granitemoehybrid": "GraniteMoeHybridForCausalLM", "jamba": "JambaForCausalLM",
                 "lfm2": "Lfm2ForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
                 "olmo_hybrid": "OlmoHybridForCausalLM",
                 "kimi_linear": "KimiLinearForCausalLM",
                 # Qwen3-Next's fixture quantized to float8 in blocks, as its "-FP8" release
                 "qwen3_next_fp8": "Qwen3NextForCausalLM"}
# What `save` writes each as: an image-text checkpoint's language model alone.
SAVED_AS = {**ARCHITECTURES, "qwen3_5": "Qwen3_5ForCausalLM",
            "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
# The config fields `save` writes in another form that gives the same model: LFM2's MLP width
# as it is (`transformers` computes it from `intermediate_size` and three more fields).
REWRITTEN = {"lfm2": ("intermediate_size", "block_auto_adjust_ff_dim")}
# The fixtures a run fine-tunes and saves back to their own tensors and config: one of each
# family, whose other types load through the same code (and each type's tensors and config
# fields are saved and read back bit for bit by `test_save_writes_back_what_load_reads_bit_for_bit`):
# Mamba (also `mamba_bias`, `falcon_mamba`), Mamba-2, RecurrentGemma, Gated DeltaNet with
# attention (also `qwen3_5`, `olmo_hybrid`), the same with experts (also `qwen3_5_moe`), Kimi
# Linear, Mamba-2 with attention (Falcon-H1's parallel branches and multipliers; also `bamba`,
# `nemotron_h`, `granitemoehybrid`), Jamba and LFM2. Each case compiles a training step and
# takes 8-14 s on a 2-core machine.
FINE_TUNED = ["mamba", "mamba2", "recurrent_gemma", "qwen3_5_text", "qwen3_next", "kimi_linear",
              "falcon_h1", "jamba", "lfm2"]
# Trained with `model.scan_blocks`: its three blocks of one layer as one scanned block.
SCANNED = "falcon_h1"


@pytest.fixture(autouse=True)
def _float64_available():
  """In place of the suite's: checkpoints load, compute, train and save here in JAX's default
  configuration, 64-bit types off, as their users run them (the references are NumPy's), and
  the fine-tuning test computes a checkpoint's logits with the logits test's program."""
  with jax.enable_x64(False):
    yield


def _expected(name):
  return np.load(FIXTURES / name / "expected.npz")


def _relative_error(got, want):
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_checkpoint_computes_the_logits_and_greedy_text_of_transformers(name):
  expected = _expected(name)
  ids, steps = expected["input_ids"], expected["generated"].shape[1]
  model, variables, config = ssmkit.pretrained.load(FIXTURES / name)
  assert config["architectures"] == [ARCHITECTURES[name]]
  assert _relative_error(compiled.run(model)(variables, ids), expected["logits"]) < 1e-4
  # Prefill, then one token at a time from the state.
  np.testing.assert_array_equal(layers.generate(model, variables, ids, steps, temperature=0.0),
                                expected["generated"])
  twin, state, _ = ssmkit.pretrained.load(FIXTURES / name, nnx=True)
  assert isinstance(twin, snx.SequenceModel) and jax.tree.leaves(state)
  assert _relative_error(nnx.jit(lambda m, x: m(x))(twin, ids), expected["logits"]) < 1e-4
  if name in ("recurrent_gemma", "qwen3_5_text"):  # NNX decoding through recurrent and KV caches
    np.testing.assert_array_equal(snx.generate(twin, ids, steps, temperature=0.0),
                                  expected["generated"])


def test_a_configuration_is_traced_once_however_often_it_loads():
  """`load` traces a model's initialisation (for its variables' shapes) once per configuration:
  the checkpoint's NNX twin, and the checkpoint again, reuse the trace."""
  ssmkit.pretrained.load(FIXTURES / "mamba")
  traced = pretrained_load.variable_shapes.cache_info()
  ssmkit.pretrained.load(FIXTURES / "mamba", nnx=True)
  ssmkit.pretrained.load(FIXTURES / "mamba")
  again = pretrained_load.variable_shapes.cache_info()
  assert (again.hits, again.misses) == (traced.hits + 2, traced.misses)


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])
def test_an_abstract_load_reads_config_json_alone(name, tmp_path):
  """`abstract=True`: the model, and the shapes and dtypes of the variables that a load with
  the weights gives (linen and NNX), from a folder that holds config.json and nothing else."""
  (tmp_path / "config.json").write_bytes((FIXTURES / name / "config.json").read_bytes())
  described = lambda tree: jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)
  model, variables, config = ssmkit.pretrained.load(tmp_path, abstract=True)
  loaded, weights, _ = ssmkit.pretrained.load(FIXTURES / name)
  assert model == loaded and config["model_type"] == name
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(variables))
  assert described(variables) == described(weights)
  _, state, _ = ssmkit.pretrained.load(tmp_path, abstract=True, nnx=True)
  assert described(state) == described(ssmkit.pretrained.load(FIXTURES / name, nnx=True)[1])
  with pytest.raises(ssmkit.pretrained.CheckpointError, match="no weights to load"):
    ssmkit.pretrained.load(tmp_path)


def _copy(tmp_path, name="mamba"):
  folder = tmp_path / name
  shutil.copytree(FIXTURES / name, folder)
  return folder


def _logits(folder):
  model, variables, _ = ssmkit.pretrained.load(folder)
  return np.asarray(compiled.run(model)(variables, _expected("mamba")["input_ids"]))


def test_sharded_and_bfloat16_checkpoints_load(tmp_path):
  folder = _copy(tmp_path)
  tensors = load_file(str(folder / "model.safetensors"))
  (folder / "model.safetensors").unlink()
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for shard, members in shards.items():
    save_file({n: tensors[n] for n in members}, str(folder / shard))
  weight_map = {n: shard for shard, members in shards.items() for n in members}
  (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  np.testing.assert_array_equal(_logits(folder), _logits(FIXTURES / "mamba"))
  # bfloat16 weights widen exactly: every parameter is the float32 one rounded to bfloat16.
  rounded = _copy(tmp_path / "bf16")
  save_jax({n: jnp.asarray(v, jnp.bfloat16) for n, v in tensors.items()},
           str(rounded / "model.safetensors"))
  _, exact, _ = ssmkit.pretrained.load(FIXTURES / "mamba")
  _, widened, _ = ssmkit.pretrained.load(rounded)
  round_trip = lambda v: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(got, round_trip(want)), widened, exact)
  assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(widened))


def _edit_config(folder, **changes):
  path = folder / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_config_field(folder, name):
  path = folder / "config.json"
  values = json.loads(path.read_text())
  del values[name]
  path.write_text(json.dumps(values))


def _edit_weights(folder, edit):
  path = folder / "model.safetensors"
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # `model_type` chooses the architecture, as in transformers; `architectures` must agree.
        (lambda f: _edit_config(f, architectures=["GPT2LMHeadModel"]),
         r"`architectures` \['GPT2LMHeadModel'\] contradicts `model_type` 'mamba', whose model "
         r"is a MambaForCausalLM"),
        (lambda f: _edit_config(f, model_type="mamba2"),
         r"`architectures` \['MambaForCausalLM'\] contradicts `model_type` 'mamba2'"),
        (lambda f: _edit_config(f, model_type="llama"),
         r"`model_type` 'llama' is not one ssmkit loads \(bamba, falcon_h1, falcon_mamba, "
         r"granitemoehybrid, jamba, kimi_linear, lfm2, mamba, mamba2, "
         r"nemotron_h, olmo_hybrid, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_next, "
         r"recurrent_gemma\)"),
        (lambda f: _drop_config_field(f, "model_type"), r"the field `model_type` is missing"),
        (lambda f: _edit_config(f, expand=1.5), r"`expand` must be a positive integer"),
        (lambda f: _edit_config(f, hidden_act="gelu"), r"`hidden_act`='gelu' is not supported"),
        (lambda f: _edit_config(f, hidden_size=None), r"the field `hidden_size` is missing"),
        (lambda f: _edit_weights(f, lambda t: t.pop("backbone.layers.1.mixer.D")),
         r"the weight 'backbone.layers.1.mixer.D' is missing"),
        (lambda f: _edit_weights(f, lambda t: t.update({"backbone.norm_f.weight": np.ones(3)})),
         r"the weight 'backbone.norm_f.weight' has shape \(3,\), expected \(32,\)"),
        (lambda f: _edit_weights(f, lambda t: t.update({"backbone.extra": np.ones(3)})),
         r"weights that ssmkit's model has no place for: \['backbone.extra'\]"),
        (lambda f: (f / "model.safetensors").unlink(), r"holds neither model.safetensors nor"),
        (lambda f: (f / "model.safetensors").write_bytes(b"not a tensor file"),
         r"model.safetensors cannot be read as safetensors"),
        (lambda f: (f / "config.json").unlink(), r"config.json does not exist"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_named(change, message, tmp_path):
  folder = _copy(tmp_path)
  change(folder)
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=message):
    ssmkit.pretrained.load(folder)


EXPERT = "model.layers.2.mlp.experts.1.up_proj"  # a linear layer of the float8 fixture


def _edit_float8(folder, edit):
  """`_edit_weights` for a checkpoint with float8 tensors, which safetensors' NumPy reader
  does not take."""
  tensors = read_weights(folder)
  edit(tensors)
  save_jax({name: jnp.asarray(value) for name, value in tensors.items()},
           str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: _edit_config(f, quantization_config={"quant_method": "bitsandbytes"}),
         r"`quantization_config.quant_method` 'bitsandbytes': ssmkit loads the float8 "),
        (lambda f: _edit_config(f, quantization_config={
            "quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [8, 8]}),
         r"`quantization_config.activation_scheme` 'static'"),
        (lambda f: _edit_config(f, quantization_config={"quant_method": "fp8",
                                                        "weight_block_size": [16, 8]}),
         r"the scales '[\w.]+_scale_inv' have shape \(\d+, \d+\), expected \(\d+, \d+\): "
         r"one per block of 16 x 8"),
        (lambda f: _drop_config_field(f, "quantization_config"),
         r"the weight '[\w.]+' is float8, but config.json has no `quantization_config`"),
        (lambda f: _edit_float8(f, lambda t: t.pop(f"{EXPERT}.weight_scale_inv")),
         rf"the weight '{EXPERT}.weight' is float8 without scales"),
        (lambda f: _edit_float8(f, lambda t: t.pop(f"{EXPERT}.weight")),
         rf"the scales '{EXPERT}.weight_scale_inv' have no weight"),
    ],
)
def test_a_float8_checkpoint_that_does_not_fit_is_named(change, message, tmp_path):
  folder = _copy(tmp_path, "qwen3_next_fp8")
  change(folder)
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=message):
    ssmkit.pretrained.load(folder)


def test_float8_tensors_read_as_written(tmp_path):
  """Each float8 dtype of safetensors (which its NumPy reader does not take) beside others."""
  rng = np.random.default_rng(0)
  written = {"e4m3": rng.normal(size=(3, 5)).astype(jnp.float8_e4m3fn),
             "e5m2": rng.normal(size=(2, 7)).astype(jnp.float8_e5m2),
             "e8m0": (2.0 ** rng.integers(-5, 5, (4,))).astype(jnp.float8_e8m0fnu),
             "float": rng.normal(size=(3,)).astype(np.float32)}
  save_jax({name: jnp.asarray(value) for name, value in written.items()},
           str(tmp_path / "model.safetensors"))
  read = read_weights(tmp_path)
  assert sorted(read) == sorted(written)
  for name, value in written.items():
    assert read[name].dtype == value.dtype and read[name].shape == value.shape
    np.testing.assert_array_equal(read[name].astype(np.float32), value.astype(np.float32))


def test_a_config_without_architectures_loads_by_its_model_type(tmp_path):
  folder = _copy(tmp_path)
  _drop_config_field(folder, "architectures")
  np.testing.assert_array_equal(_logits(folder), _logits(FIXTURES / "mamba"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 3}, r"`num_heads` x `head_dim` = 48 must be `expand` x `hidden_size` = 64"),
        ({"time_step_limit": [0.1]}, r"`time_step_limit` must be \[low, high\], got \[0.1\]"),
        ({"n_groups": 3}, r"config.json gives a model ssmkit cannot build: `n_groups`=3 must divide"),
    ],
)
def test_a_mamba2_config_that_does_not_fit_is_named(changes, message, tmp_path):
  folder = _copy(tmp_path, "mamba2")
  _edit_config(folder, **changes)
  with pytest.raises(ValueError, match=message):
    ssmkit.pretrained.load(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, r"`attention_bias`=True is not supported"),
        ({"hidden_activation": "relu"}, r"`hidden_activation`='relu' is not supported"),
        ({"block_types": ["recurrent", "mlp"]}, r"`block_types` \['mlp'\] are not RecurrentGemma"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}},
         r"`rope_parameters.rope_type`='linear' is not supported"),
    ],
)
def test_a_recurrent_gemma_config_that_does_not_fit_is_named(changes, message, tmp_path):
  folder = _copy(tmp_path, "recurrent_gemma")
  _edit_config(folder, **changes)
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=message):
    ssmkit.pretrained.load(folder)


def _edit_text_config(folder, **changes):
  path = folder / "config.json"
  values = json.loads(path.read_text())
  path.write_text(json.dumps({**values, "text_config": {**values["text_config"], **changes}}))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("qwen3_5_text", lambda f: _edit_config(f, layer_types=["linear_attention"] * 3),
         r"`layer_types` must give 'linear_attention' or 'full_attention' for each of the 4"),
        ("qwen3_5_text", lambda f: _edit_config(f, linear_value_head_dim=12),
         r"`linear_value_head_dim`=12 must be a multiple of `linear_key_head_dim`=8"),
        ("qwen3_5_text", lambda f: _edit_config(f, rope_parameters={"partial_rotary_factor": 0.3125}),
         r"`partial_rotary_factor`=0.3125 rotates 5 of 16 channels, an odd number"),
        ("qwen3_5_text", lambda f: _edit_config(f, hidden_act="gelu"),
         r"`hidden_act`='gelu' is not supported"),
        # The image-text checkpoint: its language model's fields and weights are named as stored.
        ("qwen3_5", lambda f: _drop_config_field(f, "text_config"),
         r"config.json: the field `text_config` is missing"),
        ("qwen3_5", lambda f: _edit_text_config(f, linear_num_value_heads=3),
         r"config.json \(text_config\) gives a model ssmkit cannot build: `num_v_heads`=3"),
        ("qwen3_5", lambda f: _edit_weights(f, lambda t: t.pop("model.language_model.norm.weight")),
         r"the weight 'model.language_model.norm.weight' is missing"),
        ("qwen3_5", lambda f: _edit_weights(f, lambda t: t.update({"model.extra": np.ones(3)})),
         r"no place for: \['model.extra'\]"),
        ("qwen3_5", lambda f: _edit_config(f, architectures=["Qwen3_5ForCausalLM"]),
         r"contradicts `model_type` 'qwen3_5', whose model is a Qwen3_5ForConditionalGeneration"),
        ("bamba", lambda f: _edit_config(f, mamba_d_head=12),
         r"`mamba_n_heads` x `mamba_d_head` = 48 must be `mamba_expand` x `hidden_size` = 64"),
        ("bamba", lambda f: _edit_config(f, mamba_proj_bias=True),
         r"`mamba_proj_bias`=True is not supported"),
        ("bamba", lambda f: _edit_config(f, attn_layer_indices=[3]),
         r"`attn_layer_indices` must list layers of the 3, got \[3\]"),
        ("bamba", lambda f: _edit_config(f, time_step_limit=[0.0]),
         r"`time_step_limit` must be \[low, high\], got \[0.0\]"),
        ("nemotron_h", lambda f: _edit_config(f, layers_block_type=["mamba", "conv"]),
         r"`layers_block_type` has block kinds ssmkit does not know: \['conv'\]"),
        ("nemotron_h", lambda f: _edit_config(f, moe_latent_size=8),
         r"`moe_latent_size`=8 is not supported"),
        ("nemotron_h", lambda f: _edit_config(f, mlp_hidden_act="silu"),
         r"`mlp_hidden_act`='silu' is not supported"),
        ("granitemoehybrid", lambda f: _edit_config(f, position_embedding_type="alibi"),
         r"`position_embedding_type`='alibi' is not supported"),
        ("granitemoehybrid", lambda f: _edit_config(f, layer_types=["mamba", "mlp"]),
         r"`layer_types` must give 'linear_attention' or 'full_attention' for each layer"),
        ("jamba", lambda f: _edit_config(f, mamba_proj_bias=True),
         r"`mamba_proj_bias`=True is not supported"),
        ("jamba", lambda f: _edit_config(f, num_experts_per_tok=5),
         r"gives experts ssmkit cannot build: `top_k`=5 must be at most `num_experts`=4"),
        ("lfm2", lambda f: _edit_config(f, layer_types=["conv", "mamba", "conv"]),
         r"`layer_types` must give 'conv' or 'full_attention' for each of the 3 layers"),
        ("lfm2", lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn"}),
         r"`rope_parameters.rope_type`='yarn' is not supported"),
        ("falcon_h1", lambda f: _edit_config(f, mamba_d_ssm=40),
         r"`mamba_n_heads` x `mamba_d_head` = 48 must be the inner width `mamba_d_ssm`"),
        ("falcon_h1", lambda f: _edit_config(f, projectors_bias=True),
         r"`projectors_bias`=True is not supported"),
        ("falcon_h1", lambda f: _edit_config(f, ssm_multipliers=[1.0, 2.0]),
         r"`ssm_multipliers` must be 5 positive numbers, got \[1.0, 2.0\]"),
        ("falcon_h1", lambda f: _edit_config(f, key_multiplier=0),
         r"`key_multiplier` must be a positive number, got 0"),
        ("falcon_h1", lambda f: _edit_weights(f, lambda t: t.pop("model.layers.1.mamba.norm.weight")),
         r"the weight 'model.layers.1.mamba.norm.weight' is missing"),
        ("olmo_hybrid", lambda f: _edit_config(f, layer_types=["linear_attention"] * 4),
         r"`layer_types` must give 'linear_attention' or 'full_attention' for each of the 4 "
         r"layers, each at least once"),
        ("olmo_hybrid", lambda f: _edit_config(f, linear_value_head_dim=12),
         r"`linear_value_head_dim`=12 must be a multiple of `linear_key_head_dim`=8"),
        ("olmo_hybrid", lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn",
                                                                   "rope_theta": 1e4}),
         r"`rope_parameters.rope_type`='yarn' is not supported"),
        ("olmo_hybrid", lambda f: _edit_weights(f, lambda t: t.update({
            "model.layers.2.linear_attn.v_conv1d.weight": np.ones((31, 1, 4), np.float32)})),
         r"the weights 'model.layers.2.linear_attn.\{q,k,v\}_conv1d.weight' have shapes"),
        ("kimi_linear", lambda f: _edit_config(f, num_key_value_heads=2),
         r"`num_key_value_heads`=2 is not supported"),
        ("kimi_linear", lambda f: _edit_config(f, mlp_layer_types=["dense", "moe"] * 2),
         r"`mlp_layer_types` must give 'dense' or 'sparse' for each of the 4 layers"),
        ("kimi_linear", lambda f: _edit_config(f, num_experts_per_token=5),
         r"gives experts ssmkit cannot build: `top_k`=5 must be at most `num_experts`=4"),
        ("kimi_linear", lambda f: _edit_weights(
            f, lambda t: t.pop("model.layers.3.block_sparse_moe.gate.e_score_correction_bias")),
         r"the weight 'model.layers.3.block_sparse_moe.gate.e_score_correction_bias' is missing"),
        ("qwen3_next", lambda f: _edit_config(f, mlp_only_layers=[1]),
         r"`decoder_sparse_step`=1 and `mlp_only_layers`=\[1\] give blocks without experts"),
        ("qwen3_next", lambda f: _edit_config(f, num_experts_per_tok=5),
         r"`top_k`=5 must be at most `num_experts`=4"),
        ("qwen3_next", lambda f: _edit_weights(
            f, lambda t: t.pop("model.layers.2.mlp.experts.3.down_proj.weight")),
         r"the weight 'model.layers.2.mlp.experts.3.down_proj.weight' is missing"),
    ],
)
def test_a_hybrid_checkpoint_that_does_not_fit_is_named(name, change, message, tmp_path):
  folder = _copy(tmp_path, name)
  change(folder)
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=message):
    ssmkit.pretrained.load(folder)


def test_an_olmo_hybrid_without_rope_theta_attends_without_positions(tmp_path):
  """The published OLMo Hybrid checkpoints have no rotary embedding (`rope_theta` null), and
  without `rope_parameters` the base is 10,000; without `layer_types` every fourth layer
  attends: as transformers fills them in."""
  folder = _copy(tmp_path, "olmo_hybrid")
  _drop_config_field(folder, "rope_parameters")
  default, _, _ = ssmkit.pretrained.load(folder)
  assert default.layer[1].keywords["rope_base"] == 10_000.0
  assert default.layer[1].keywords["rope_fraction"] == 1.0
  _edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": None})
  model, variables, _ = ssmkit.pretrained.load(folder)
  kinds = [(make.func.__name__, make.keywords.get("rope_fraction")) for make in model.layer]
  assert kinds == [("GatedDeltaNet", None), ("Attention", 0.0)] * 2
  assert model.norm_position == ("input", "output") * 2
  ssmkit.pretrained.save(model, variables, tmp_path / "out")
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": None}
  jax.tree.map(np.testing.assert_array_equal, ssmkit.pretrained.load(tmp_path / "out")[1],
               variables)
  values = json.loads((folder / "config.json").read_text())
  del values["layer_types"]
  options = olmo_hybrid.options(Fields({**values, "num_hidden_layers": 8}, folder))
  assert [make.func.__name__ for make in options["layer"]] == (["GatedDeltaNet"] * 3
                                                              + ["Attention"]) * 2


def test_a_qwen_config_without_layer_types_attends_every_fourth_layer(tmp_path):
  """As transformers fills `layer_types` in (`full_attention_interval`, 4 by default)."""
  folder = _copy(tmp_path, "qwen3_5_text")
  _drop_config_field(folder, "layer_types")
  model, variables, _ = ssmkit.pretrained.load(folder)
  expected = _expected("qwen3_5_text")
  assert _relative_error(compiled.run(model)(variables, expected["input_ids"]),
                         expected["logits"]) < 1e-4
  values = {**json.loads((folder / "config.json").read_text()), "full_attention_interval": 2}
  pattern = qwen3_5.options(Fields(values, folder))["layer"]
  assert [make.func.__name__ for make in pattern] == ["GatedDeltaNet", "Attention"] * 2


def test_a_nemotron_h_pattern_string_gives_the_same_model(tmp_path):
  """The hub's Nemotron-H configs give the pattern as `hybrid_override_pattern`."""
  folder = _copy(tmp_path, "nemotron_h")
  _drop_config_field(folder, "layers_block_type")
  _edit_config(folder, hybrid_override_pattern="ME*-")
  model, variables, _ = ssmkit.pretrained.load(folder)
  expected = _expected("nemotron_h")
  assert _relative_error(compiled.run(model)(variables, expected["input_ids"]),
                         expected["logits"]) < 1e-4


def test_an_image_text_checkpoint_leaves_out_its_vision_and_prediction_weights(tmp_path):
  """Qwen3.5's image-text checkpoint loads its language model alone: the vision tower and the
  multi-token prediction weights (which transformers does not load either) are left out."""
  folder = _copy(tmp_path, "qwen3_5")
  _edit_weights(folder, lambda t: t.update({"mtp.fc.weight": np.ones((2, 2), np.float32)}))
  _, variables, _ = ssmkit.pretrained.load(folder)
  jax.tree.map(np.testing.assert_array_equal, variables,
               ssmkit.pretrained.load(FIXTURES / "qwen3_5")[1])


def test_a_computation_dtype_that_is_none_is_named():
  for dtype in ("bfloat17", "int8"):
    with pytest.raises(ValueError, match=rf"`dtype` must be a floating dtype .* got {dtype!r}"):
      ssmkit.pretrained.load(FIXTURES / "mamba", dtype=dtype)


def test_a_path_that_is_no_checkpoint_is_named(tmp_path):
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=r"neither a checkpoint directory nor"):
    ssmkit.pretrained.load(tmp_path / "nothing" / "here" / "at_all")
  for path in ("/nothing", "./nothing", "~/nothing"):  # one slash, but paths, not repository ids
    with pytest.raises(ssmkit.pretrained.CheckpointError, match=rf"{path!r} is neither"):
      ssmkit.pretrained.load(path)
  # A repository id: downloaded where the hub extra and a network are present, named otherwise.
  with pytest.raises(ssmkit.pretrained.CheckpointError,
                     match=r"'no-such-owner/no-such-model' (is not a directory here|could not be)"):
    ssmkit.pretrained.load("no-such-owner/no-such-model")


def _scanned(model, variables):
  """`model` with its blocks under `nn.scan`, and its parameters restacked to that layout."""
  params = {k: v for k, v in variables["params"].items() if not k.startswith("block_")}
  block = lambda i: variables["params"][f"block_{i}"]
  stack = lambda indices: jax.tree.map(lambda *leaves: np.stack(leaves), *map(block, indices))
  if callable(model.layer):
    params["blocks"] = {"block": stack(range(model.num_blocks))}
  else:
    size = len(model.layer)
    repeats, rest = divmod(model.num_blocks, size)
    params["blocks"] = {f"block_{j}": stack(range(j, repeats * size, size)) for j in range(size)}
    if rest:
      params["tail"] = {f"block_{j}": stack([repeats * size + j]) for j in range(rest)}
  return model.clone(scan_blocks=True), {"params": params}


def test_blocks_under_scan_compute_the_logits_and_greedy_text_of_transformers(tmp_path):
  """`scan_blocks=True` cuts the layers to their shortest period under `nn.scan` (Bamba's three
  blocks, Mamba-2, attention, Mamba-2: one repeat of two and a tail of one; the fine-tuning test
  scans Falcon-H1's one layer): transformers' logits and greedy text through the stacked
  recurrent states and KV caches, NNX's logits, and `save` writes the checkpoint's own tensors
  back."""
  expected = _expected("bamba")
  ids, steps = expected["input_ids"], expected["generated"].shape[1]
  model, variables, _ = ssmkit.pretrained.load(FIXTURES / "bamba", scan_blocks=True)
  assert model.scan_blocks and len(model.layer) == 2 and "tail" in variables["params"]
  assert _relative_error(compiled.run(model)(variables, ids), expected["logits"]) < 1e-4
  np.testing.assert_array_equal(layers.generate(model, variables, ids, steps, temperature=0.0),
                                expected["generated"])
  twin, _, _ = ssmkit.pretrained.load(FIXTURES / "bamba", nnx=True, scan_blocks=True)
  assert _relative_error(nnx.jit(lambda m, x: m(x))(twin, ids), expected["logits"]) < 1e-4
  ssmkit.pretrained.save(model, variables, tmp_path / "saved", source=FIXTURES / "bamba")
  jax.tree.map(np.testing.assert_array_equal, ssmkit.pretrained.load(tmp_path / "saved")[1],
               ssmkit.pretrained.load(FIXTURES / "bamba")[1])


def test_distinct_first_blocks_scan_as_a_head_before_the_repeats(tmp_path):
  """Kimi Linear's first layer has a dense MLP where the others have experts, so its blocks
  (mixer, MLP per layer) have no period from the first: its fixture deepened to 7 layers (the
  new layers' tensors those of the layer two before, each scaled apart) scans its first two
  blocks as a head, then 3 repeats of the 4 after them, to the unrolled model's logits, and
  saves back to the folder's tensors bit for bit (tests/test_hybrid.py steps a head's states,
  tests/test_nnx.py converts one)."""
  folder = tmp_path / "deep"
  shutil.copytree(FIXTURES / "kimi_linear", folder)
  config = json.loads((folder / "config.json").read_text())
  tensors = load_file(folder / "model.safetensors")
  for i in range(4, 7):
    config["layer_types"].append(config["layer_types"][i - 2])
    config["mlp_layer_types"].append("sparse")
    for name, value in list(tensors.items()):
      if name.startswith(f"model.layers.{i - 2}."):
        tensors[name.replace(f".{i - 2}.", f".{i}.", 1)] = value * np.float32(1 + 0.1 * i)
  config["num_hidden_layers"] = 7
  (folder / "config.json").write_text(json.dumps(config))
  save_file(tensors, folder / "model.safetensors")
  ids = _expected("kimi_linear")["input_ids"][:, :12]
  unrolled, weights, _ = ssmkit.pretrained.load(folder)
  model, variables, _ = ssmkit.pretrained.load(folder, scan_blocks=True)
  scans = {name for name in variables["params"] if name in ("head", "blocks", "tail")}
  assert (model.head_blocks, len(model.layer), scans) == (2, 6, {"head", "blocks"})
  assert _relative_error(compiled.run(model)(variables, ids),
                         np.asarray(compiled.run(unrolled)(weights, ids))) < 1e-6
  ssmkit.pretrained.save(model, variables, tmp_path / "saved", source=folder)
  written = load_file(tmp_path / "saved" / "model.safetensors")
  assert sorted(written) == sorted(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_save_writes_back_what_load_reads_bit_for_bit(name, tmp_path):
  """As its source's architecture (Qwen3-Next's and Qwen3.5-MoE's models are the same ssmkit
  model)."""
  model, variables, config = ssmkit.pretrained.load(FIXTURES / name)
  ssmkit.pretrained.save(model, variables, tmp_path / "linen", source=FIXTURES / name)
  twin, _, _ = ssmkit.pretrained.load(FIXTURES / name, nnx=True)
  ssmkit.pretrained.save(twin, None, tmp_path / "nnx", architecture=SAVED_AS[name])
  for folder in ("linen", "nnx"):
    _, again, written = ssmkit.pretrained.load(tmp_path / folder)
    jax.tree.map(np.testing.assert_array_equal, again, variables)
    assert written["architectures"] == [SAVED_AS[name]]
    own = config.get("text_config", config)  # an image-text checkpoint's language model
    # Without a source the special tokens are unknown: null, not the architecture's defaults.
    unknown = () if folder == "linen" else CARRIED_FIELDS
    assert all(written[key] is None for key in unknown)
    assert all(written[key] == own[key] for key in written if key in own and key not in (
        "dtype", "architectures", *REWRITTEN.get(name, ()), *unknown))
  # Blocks under nn.scan are saved one by one.
  ssmkit.pretrained.save(*_scanned(model, variables), tmp_path / "scanned",
                         architecture=SAVED_AS[name])
  jax.tree.map(np.testing.assert_array_equal, ssmkit.pretrained.load(tmp_path / "scanned")[1],
               variables)


def _nearest_bfloat16(x):
  """float32 values rounded to the nearest bfloat16 (8 significant bits, ties to even), in
  float64 NumPy."""
  mantissa, exponent = np.frexp(np.asarray(x, np.float64))
  return np.ldexp(np.round(mantissa * 256) / 256, exponent)


@pytest.mark.parametrize("name", ["mamba2", "kimi_linear", "nemotron_h"])
def test_save_in_bfloat16_rounds_every_tensor_but_those_transformers_keeps_in_float32(name, tmp_path):
  """`dtype="bfloat16"`: each tensor is the float32 one rounded to the nearest bfloat16, but the
  tensors `transformers` keeps in float32 (Kimi Linear's and Nemotron-H's routers and
  correction biases, Kimi Linear's `dt_bias`), written as they are; config.json says so, and the
  checkpoint loads back to those values exactly."""
  model, variables, _ = ssmkit.pretrained.load(FIXTURES / name)
  for dtype in ("float32", "bfloat16"):
    ssmkit.pretrained.save(model, variables, tmp_path / dtype, source=FIXTURES / name, dtype=dtype)
  full, half = (load_file(tmp_path / dtype / "model.safetensors") for dtype in ("float32", "bfloat16"))
  kept = {"mamba2": (), "kimi_linear": ("gate.weight", "e_score_correction_bias", "dt_bias"),
          "nemotron_h": ("gate.weight", "e_score_correction_bias")}[name]
  assert sorted(half) == sorted(full)
  assert {k for k in half if half[k].dtype == np.float32} == {k for k in full if any(
      part in k for part in kept)} and (not kept or any(half[k].dtype == np.float32 for k in half))
  for key, value in half.items():
    expected = full[key] if value.dtype == np.float32 else _nearest_bfloat16(full[key])
    assert value.dtype in (np.float32, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(value, np.float64), expected, err_msg=key)
  assert json.loads((tmp_path / "bfloat16" / "config.json").read_text())["dtype"] == "bfloat16"
  loaded, rounded, _ = ssmkit.pretrained.load(tmp_path / "bfloat16")
  ssmkit.pretrained.save(loaded, rounded, tmp_path / "again")
  for key, value in load_file(tmp_path / "again" / "model.safetensors").items():
    np.testing.assert_array_equal(value, np.asarray(half[key], np.float32), err_msg=key)
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=r"`dtype` must be one of "):
    ssmkit.pretrained.save(model, variables, tmp_path / "int8", dtype="int8")


def test_save_shards_a_checkpoint_past_shard_bytes(tmp_path):
  """Past `shard_bytes`, shards of at most that many bytes with an index naming every tensor's
  file, as `save_pretrained` writes them; saved again in one file, the shards and index go."""
  model, variables, _ = ssmkit.pretrained.load(FIXTURES / "mamba")
  ssmkit.pretrained.save(model, variables, tmp_path, shard_bytes=20_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
  assert len(shards) > 1 and [p.name for p in shards] == [
      f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
  tensors = {p.name: load_file(p) for p in shards}
  assert all(sum(v.nbytes for v in held.values()) <= 20_000 or len(held) == 1
             for held in tensors.values())
  assert index["weight_map"] == {name: file for file, held in tensors.items() for name in held}
  assert index["metadata"]["total_size"] == sum(
      v.nbytes for held in tensors.values() for v in held.values())
  jax.tree.map(np.testing.assert_array_equal, ssmkit.pretrained.load(tmp_path)[1], variables)
  ssmkit.pretrained.save(model, variables, tmp_path)
  assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
  jax.tree.map(np.testing.assert_array_equal, ssmkit.pretrained.load(tmp_path)[1], variables)
  for bad in (0, 2.5e9):
    with pytest.raises(ssmkit.pretrained.CheckpointError, match=r"`shard_bytes` must be a positive"):
      ssmkit.pretrained.save(model, variables, tmp_path / "bad", shard_bytes=bad)


def _zeros(model):
  """Variables of `model`'s shapes, all zero."""
  shapes = pretrained_load.variable_shapes(model)
  return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)


def test_save_names_what_no_architecture_expresses(tmp_path):
  model, variables, _ = ssmkit.pretrained.load(FIXTURES / "mamba2")
  cases = [
      # (with SwiGLU MLPs it would be a Bamba)
      (model.clone(mlp="gelu"), variables,
       r"`model.mlp`='gelu': a Mamba2ForCausalLM has mlp='none'"),
      (model.clone(layer=layers.LRU), variables, r"its layers \(LRU\) make no architecture that "
       r"save writes \(Mamba: MambaForCausalLM, .*; KimiDeltaAttention \+ LatentAttention \+ "
       r"FeedForward: KimiLinearForCausalLM"),
      (model, {"params": {}}, r"`variables\['params'\]` do not fill ssmkit's model: missing "
       r"\['block_0/"),
      (model, [variables], r"`variables` must be the model's variables"),
      # A pattern of Mamba-2 blocks without MLPs is a Nemotron-H's, whose step sizes are not
      # clipped above.
      (model.clone(layer=(model.layer, model.layer)), variables,
       r"a NemotronHForCausalLM needs Mamba2 to be norm_per_group=True, norm_eps=1e-05, "
       r"dt_limit=\(low, inf\)"),
      (model.clone(decoder_bias=True),
       {"params": {**variables["params"], "decoder": {**variables["params"]["decoder"],
                                                       "bias": np.ones(96, np.float32)}}},
       r"the untied decoder has a bias that is not zero"),
      (model.clone(layer=functools.partial(model.layer, norm_per_group=False)), variables,
       r"n_groups > 1 must normalise per group"),
  ]
  griffin, weights, _ = ssmkit.pretrained.load(FIXTURES / "recurrent_gemma")
  cases += [
      (griffin.clone(scale_embeddings=True), weights,
       r"needs model.scale_embeddings to be sqrt\(features\) rounded to bfloat16, 5.65625"),
      (griffin.clone(mlp="swiglu"), weights, r"`model.mlp`='swiglu': a RecurrentGemmaForCausalLM"),
  ]
  qwen, qwen_weights, _ = ssmkit.pretrained.load(FIXTURES / "qwen3_5_text")
  falcon, falcon_weights, _ = ssmkit.pretrained.load(FIXTURES / "falcon_h1")
  # Models whose variables fit them, which no architecture expresses.
  parallel = falcon.clone(layer=functools.partial(layers.Parallel, layers=("mamba2", "short_conv")))
  gated = model.clone(layer=functools.partial(model.layer, gate_norm="gate"))
  cases += [
      # A factor an architecture does not write is refused, not dropped.
      (qwen.clone(mlp_scales=(0.5, 1.0)), qwen_weights,
       r"`model.mlp_scales`=\(0.5, 1.0\): a Qwen3_5ForCausalLM has mlp_scales=\(1.0, 1.0\)"),
      (falcon.clone(residual_scale=0.5), falcon_weights,
       r"`model.residual_scale`=0.5: a FalconH1ForCausalLM has residual_scale=1.0"),
      (parallel, _zeros(parallel),
       r"a FalconH1ForCausalLM has one Parallel layer of Mamba2 then Attention"),
      (gated, _zeros(gated), r"a Mamba2ForCausalLM has Mamba2 layers with gate_norm='norm_gated'"),
  ]
  for bad, values, message in cases:
    with pytest.raises(ssmkit.pretrained.CheckpointError, match=message):
      ssmkit.pretrained.save(bad, values, tmp_path / "out")
  # Qwen3-Next's models are Qwen3.5-MoE's too: `architecture` (or the source) chooses.
  moe, experts, _ = ssmkit.pretrained.load(FIXTURES / "qwen3_next")
  for architecture in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
    ssmkit.pretrained.save(moe, experts, tmp_path / architecture, architecture=architecture)
    assert ssmkit.pretrained.load(tmp_path / architecture)[2]["architectures"] == [architecture]
  with pytest.raises(ssmkit.pretrained.CheckpointError,
                     match=r"`architecture` 'MambaForCausalLM' does not express `model`"):
    ssmkit.pretrained.save(moe, experts, tmp_path / "out", architecture="MambaForCausalLM")
  with pytest.raises(ssmkit.pretrained.CheckpointError,
                     match=r"a Qwen3_5MoeForCausalLM routes by softmax without scaling"):
    ssmkit.pretrained.save(moe.clone(experts=dataclasses.replace(moe.experts, routed_scale=2.0)),
                           experts, tmp_path / "out")
  relu2 = moe.clone(experts=dataclasses.replace(moe.experts, activation="relu2"))
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=r"to SwiGLU experts"):
    ssmkit.pretrained.save(relu2, _zeros(relu2), tmp_path / "out")


def _transformers():
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.mark.skipif(not _transformers(), reason="needs torch and transformers, which the test "
                    "extra does not install (scripts/make_pretrained_fixtures.py says how)")
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_transformers_loads_what_save_writes(name, tmp_path):
  import torch
  import transformers

  model, variables, _ = ssmkit.pretrained.load(FIXTURES / name)
  ssmkit.pretrained.save(model, variables, tmp_path, source=FIXTURES / name)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(loaded).__name__ == SAVED_AS[name]
  expected = _expected(name)
  with torch.no_grad():
    logits = loaded(torch.as_tensor(expected["input_ids"], dtype=torch.long)).logits.numpy()
  assert _relative_error(logits, expected["logits"]) < 1e-4
  # In bfloat16, computed in float32 by both: rounded weights move the float32 disagreement
  # of the two implementations (up to 1.0e-4 for Qwen3.5 in one run).
  ssmkit.pretrained.save(model, variables, tmp_path / "half", source=FIXTURES / name,
                         dtype="bfloat16")
  rounded = ssmkit.pretrained.load(tmp_path / "half")[1]
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "half",
                                                             dtype=torch.float32).eval()
  with torch.no_grad():
    logits = loaded(torch.as_tensor(expected["input_ids"], dtype=torch.long)).logits.numpy()
  ours = np.asarray(compiled.run(model)(rounded, expected["input_ids"]), np.float64)
  assert _relative_error(logits, ours) < 3e-4


@pytest.mark.parametrize("name", ["recurrent_gemma", "qwen3_5"])
def test_generate_continues_text_as_transformers_does(name, capsys):
  """`ssmkit generate --pretrained`: the fixture's ids as text, continued greedily, decode to
  the ids `transformers` generated, up to the end-of-text token (2), where the command stops."""
  expected = _expected(name)
  coder = ssmkit.pretrained.tokenizer(FIXTURES / name)
  prompt = coder.decode(expected["input_ids"][0])
  assert cli.main(["generate", "--pretrained", str(FIXTURES / name), "--prompt", prompt,
                   "--max-tokens", "20", "--temperature", "0"]) == 0
  generated = expected["generated"][0]
  ends = np.flatnonzero(generated == coder.eod)
  whole = np.concatenate([expected["input_ids"][0], generated[:ends[0] if ends.size else None]])
  assert capsys.readouterr().out.rstrip("\n") == coder.decode(whole)


def test_a_checkpoint_without_a_tokenizer_is_named_by_generate(tmp_path, capsys):
  folder = _copy(tmp_path)
  (folder / "tokenizer.json").unlink()
  assert cli.main(["generate", "--pretrained", str(folder), "--prompt", "t5"]) == 2
  assert "tokenizer.json does not exist" in capsys.readouterr().err
  assert cli.main(["generate", "--pretrained", str(FIXTURES / "mamba"), "--prompt", " "]) == 2
  assert "`prompt` ' ' encodes to no token" in capsys.readouterr().err


def test_an_lm_run_saves_as_a_checkpoint(tmp_path):
  """An `lm_mamba2` run without MLPs, with a tied head and one norm epsilon (the published
  architecture), saved as the trainer builds it, loads back to the same logits; the shipped
  config's norms, of two epsilons, are named."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(20):
    (corpus / f"doc{i}.py").write_text(f"def f{i}(x):\n  return x * {i}\n" * (i % 3 + 1))
  overrides = [f"data.path={corpus}", "data.seq_len=16", "data.batch_size=4",
               "data.validation_fraction=0.3", "model.features=32", "model.num_blocks=2",
               "model.mlp=none", "model.tie_embeddings=true", "model.norm_eps=1e-5",
               "mesh.data=1"]
  run = train.supervised.setup(train.load_config("lm_mamba2", overrides), lm_train.TASK)
  model, variables = run.model, {"params": jax.device_get(run.state.params)}
  ssmkit.pretrained.save(model, variables, tmp_path / "checkpoint")
  loaded, again, config = ssmkit.pretrained.load(tmp_path / "checkpoint")
  assert config["architectures"] == ["Mamba2ForCausalLM"] and config["vocab_size"] == 257
  tokens = np.arange(12, dtype=np.int32)[None] + 40
  np.testing.assert_array_equal(compiled.run(loaded)(again, tokens),
                                compiled.run(model)(variables, tokens))
  with pytest.raises(ssmkit.pretrained.CheckpointError, match=r"`model.norm_eps`=None: a Mamba2"):
    ssmkit.pretrained.save(model.clone(norm_eps=None), variables, tmp_path / "other")


def _word_corpus(folder, seed=4):
  """Documents of the fixtures' words, t3 ... t95, for their word-level tokenizer; each
  shorter than the prompts of the samples a run prints (which would compile `generate` in
  every fine-tuning test)."""
  folder.mkdir()
  rng = np.random.default_rng(seed)
  prompt = train.lm.LMSamplesConfig.prompt_tokens
  for i in range(40):
    words = " ".join(f"t{w}" for w in rng.integers(3, 96, rng.integers(5, prompt)))
    (folder / f"doc{i}.txt").write_text(words, encoding="utf-8")
  return folder


@pytest.mark.parametrize("name", FINE_TUNED)
def test_a_fine_tuned_checkpoint_saves_back_as_its_architecture(name, tmp_path, capsys):
  """load -> `ssmkit train` a few steps, its loss falling -> `ssmkit export`: the folder holds
  the checkpoint's own tensors by transformers' names (those of the fixture transformers wrote)
  with the fine-tuned values, its config fields, tokenizer and generation config, and loads
  back to the run's logits bit for bit; where torch and transformers are installed,
  transformers loads it to the same logits."""
  overrides = [f"model.pretrained={FIXTURES / name}", f"data.path={_word_corpus(tmp_path / 'c')}",
               "data.seq_len=16", "data.batch_size=2", "data.validation_fraction=0.3",
               "optimizer.warmup_steps=0", "optimizer.learning_rate=0.01", "train.steps=4",
               "train.log_every=4", "train.eval_every=0", "mesh.data=1",
               f"model.scan_blocks={name == SCANNED}"]
  workdir, out = tmp_path / "run", tmp_path / "out"
  assert cli.main(["train", "lm_mamba", "--workdir", str(workdir), *overrides]) == 0
  assert cli.main(["export", "--workdir", str(workdir), str(out)]) == 0
  model, variables, _ = train.load(workdir)
  variables = jax.device_get(variables)  # as `load`'s, so one program serves both
  assert model.scan_blocks == (name == SCANNED)
  loaded, again, config = ssmkit.pretrained.load(out, scan_blocks=model.scan_blocks)
  tokens = _expected(name)["input_ids"]
  logits = np.asarray(compiled.run(model)(variables, tokens))
  np.testing.assert_array_equal(compiled.run(loaded)(again, tokens), logits)
  jax.tree.map(np.testing.assert_array_equal, again, variables)
  # The corpus's words t3 ... t95 are the tokens 3 ... 95, uniformly drawn: on such text the
  # fine-tuned model's next-token loss over the run's 16 steps is below the checkpoint's. The
  # texts have the tokens' shape: the three models are one (a checkpoint loads to equal
  # models), compiled once.
  texts = np.random.default_rng(5).integers(3, 96, (8, *tokens.shape))
  fixture, weights, _ = ssmkit.pretrained.load(FIXTURES / name, scan_blocks=model.scan_blocks)
  assert fixture == loaded == model and len({fixture, loaded, model}) == 1  # one cache key
  steps = min(16, tokens.shape[1])

  def loss(model, variables):  # in float64 NumPy, from the compiled logits
    logits = np.asarray([compiled.run(model)(variables, text) for text in texts], np.float64)
    logits = logits[:, :, :steps - 1]
    log_p = logits - scipy.special.logsumexp(logits, -1, keepdims=True)
    return -np.take_along_axis(log_p, texts[:, :, 1:steps, None], -1).mean()

  assert loss(model, variables) < loss(fixture, weights)
  original = load_file(FIXTURES / name / "model.safetensors")
  written = load_file(out / "model.safetensors")
  assert sorted(written) == sorted(original)
  assert any(not np.array_equal(written[k], original[k]) for k in original)  # it trained
  fixture_config = json.loads((FIXTURES / name / "config.json").read_text())
  for key in set(config) & set(fixture_config) - {"dtype", "transformers_version",
                                                   *REWRITTEN.get(name, ())}:
    assert config[key] == fixture_config[key], key
  for carried in ("tokenizer.json", "generation_config.json"):
    assert (out / carried).read_bytes() == (FIXTURES / name / carried).read_bytes()
  if name == "mamba":  # the tokenizer in use (the other fixtures carry the same files)
    assert cli.main(["export", "--workdir", str(workdir), "--dtype", "bfloat16",
                     str(tmp_path / "half")]) == 0
    assert {v.dtype for v in load_file(tmp_path / "half" / "model.safetensors").values()} == {
        np.dtype(jnp.bfloat16)}
    assert cli.main(["export", "--workdir", str(workdir), "--max-shard-size", "20kB",
                     str(tmp_path / "shards")]) == 0
    assert len(list((tmp_path / "shards").glob("model-0000?-of-0000?.safetensors"))) > 1
    jax.tree.map(np.testing.assert_array_equal,
                 ssmkit.pretrained.load(tmp_path / "shards")[1], variables)
    with pytest.raises(SystemExit):
      cli.main(["export", "--workdir", str(workdir), "--max-shard-size", "5XB", str(tmp_path)])
    assert "--max-shard-size: must be a positive size such as 5GB" in capsys.readouterr().err
    assert cli.main(["generate", "--pretrained", str(out), "--prompt", "t5 t9", "--max-tokens",
                     "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split()[:2] == ["t5", "t9"]
  if _transformers():
    import torch
    import transformers

    # Over the first 13 ids: over 40, a fine-tuned Qwen3.5's float32 logits in transformers
    # were 2.6e-4 (of the largest) from ssmkit's in one run, its chunked delta rule computing in
    # float32 even for a float64 model (4.6e-5 between its two; ssmkit's float32 logits lie
    # 8e-6 from its float64 ones), as for the Qwen3-Next fixture.
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
      hf_logits = hf(torch.as_tensor(tokens[:, :13], dtype=torch.long)).logits.numpy()
    assert _relative_error(hf_logits, logits[:, :13]) < 1e-4

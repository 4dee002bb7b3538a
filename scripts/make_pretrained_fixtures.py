"""Makes the Hugging Face checkpoint fixtures of tests/fixtures/pretrained with `transformers` itself.

For each architecture that `ssmkit.pretrained` loads, a tiny random model built by
`transformers` from a small config, saved with `save_pretrained` (config.json and
model.safetensors), beside `expected.npz`: 2 x 40 input ids (2 x 13 for `SHORT`), the
model's float32 logits for them and its greedy continuation of 20
tokens, and a word-level `tokenizer.json` of the vocabulary ("<pad>", "<s>",
"<|endoftext|>", then "t3" ... "t95", one word per token), so that text
goes in and out as with a published checkpoint (`generate` re-running the whole sequence for each
token: the full forward pass defines the model, and `transformers`' cached Mamba-2 step skips
`time_step_limit`). The parameters are the
library's initialisation plus Gaussian noise of standard deviation `NOISE`, so that no weight is
a constant (norm scales of 1, zero biases) and a mapping error shows in the logits.

This script needs torch and transformers, which the test extra does not install; run it in
a separate environment, from the repository root:

    python -m venv /tmp/hf
    /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors numpy accelerate
    /tmp/hf/bin/python scripts/make_pretrained_fixtures.py [NAME ...]   # all, or these

`QUANTIZED` fixtures are another fixture's checkpoint quantized to float8 by `transformers`' own
block-wise quantizer (FineGrainedFP8, the format of Qwen's "-FP8" releases), their expected
outputs those of the model `transformers` loads from them (on a CPU it dequantizes the weights,
which needs `accelerate`).

The suite reads the files it writes; it never imports torch.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import types

import numpy as np
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "pretrained"
VOCAB, BATCH, LENGTH, NEW_TOKENS = 96, 2, 40, 20
# The fixtures made with 13 input ids: the first architectures', and Qwen3-Next's. Over 40 ids
# this random Qwen3-Next's logits in transformers 5.24 are no reference to 1e-4 (of the largest):
# its chunked Gated DeltaNet computes in float32 even in a float64 model, which puts the first
# layer's outputs 2e-7 to 4e-6 from ssmkit's float64 ones, and the later layers amplify that at
# three of the 40 positions (13, 17 and 39) to 1.9e-4 between the two float64 models (2.1e-4
# between the float32 ones; 1.8e-4 and 1.5e-4 with seeds 1 and 2), where ssmkit's float32
# logits lie 1.1e-5 from its float64 ones (transformers' experts computed by its "eager"
# implementation: the default grouped products refuse float64). Over 13 ids the two are
# 2.6e-5 apart.
SHORT = ("mamba", "mamba_bias", "falcon_mamba", "mamba2", "recurrent_gemma", "qwen3_next")
# The noise added to every initial parameter: enough for greedy decoding not to settle on one token.
NOISE = 0.5

QWEN3_5_TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2)
QWEN3_5_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                      out_hidden_size=32, patch_size=2, spatial_merge_size=1,
                      temporal_patch_size=1, num_position_embeddings=16)

CONFIGS = {
    "mamba": transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=4, use_bias=False, use_conv_bias=True,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
    # The other Mamba options: projection biases, no convolution bias, an untied head.
    "mamba_bias": transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
        conv_kernel=3, time_step_rank=2, use_bias=True, use_conv_bias=False,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
    # Mamba with RMS-normalised step-size input, B and C.
    "falcon_mamba": transformers.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=2, mixer_rms_eps=1e-6, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "mamba2": transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, expand=2, state_size=8,
        n_groups=2, conv_kernel=4, chunk_size=8, time_step_limit=(0.01, 0.5), use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Two RG-LRU blocks then local attention (one key-value head); the window is longer than
    # the 33 steps of the generation, as transformers' full forward pass does not apply it.
    "recurrent_gemma": transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=96, lru_width=32, attention_window_size=64,
        conv1d_width=4, logits_soft_cap=30.0, rms_norm_eps=1e-6,
        block_types=["recurrent", "recurrent", "attention"], tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Gated DeltaNet (two key heads read by four value heads, V = 2K) three times, then gated
    # attention with (1 + w) query and key norms and a quarter of each head rotating.
    "qwen3_5_text": transformers.Qwen3_5TextConfig(**QWEN3_5_TEXT),
    # The same language model inside Qwen3.5's image-text checkpoint (`model.language_model.*`
    # beside a vision tower ssmkit leaves out).
    "qwen3_5": transformers.Qwen3_5Config(
        text_config=QWEN3_5_TEXT, tie_word_embeddings=False, vision_config=QWEN3_5_VISION),
    # Qwen3.5's language model with a mixture of 4 experts (top 2, renormalised) and a gated
    # shared expert in every block, Gated DeltaNet's projections fused per key head.
    "qwen3_next": transformers.Qwen3NextConfig(
        **QWEN3_5_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=True),
    # Qwen3.5's mixture of experts, as published: inside an image-text checkpoint.
    "qwen3_5_moe": transformers.Qwen3_5MoeConfig(
        text_config={**{k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"},
                     "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                     "shared_expert_intermediate_size": 24},
        tie_word_embeddings=False, vision_config=QWEN3_5_VISION),
    # Mamba-2 (two groups), attention (half rotary, grouped), Mamba-2, each with a SwiGLU MLP.
    "bamba": transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2),
    # Mamba-2 of 4 heads x 12 channels (an inner width 1.5 x the model's, its step size clipped
    # below), experts (4, top 2 among 1 of 2 groups, routed scaling, a shared expert),
    # attention without positions, a squared-ReLU MLP.
    "nemotron_h": transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=12, n_groups=2, conv_kernel=4,
        chunk_size=8, time_step_min=0.05, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Bamba's pattern with experts (4, top 2) and a shared expert in every block, and Granite's
    # four multipliers; a tied head.
    "granitemoehybrid": transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=24, embedding_multiplier=1.5, logits_scaling=2.0,
        residual_multiplier=0.7, attention_multiplier=0.1, position_embedding_type="rope",
        rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
    # Mamba with scaled selective norms, attention (every 4th layer from the 3rd) and experts
    # (every 2nd from the 2nd: 4, top 2, not renormalised) or SwiGLU MLPs.
    "jamba": transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Gated short convolutions, then attention with per-head q/k norms, then a convolution;
    # the MLP width adjusted (2/3 of 96, to a multiple of 16: 64); a tied head.
    "lfm2": transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention",
                                                                   "conv"],
        conv_L_cache=3, block_multiple_of=16, norm_eps=1e-5, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Mamba-2 of 4 heads x 12 channels (an inner width 1.5 x the model's) in two groups, its
    # norm before the gate, beside grouped attention in every block; every multiplier not 1.
    "falcon_h1": transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=48, mamba_n_heads=4,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
        mamba_rms_norm=True, mamba_norm_before_gate=True, rms_norm_eps=1e-5,
        embedding_multiplier=1.5, lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.3],
        key_multiplier=0.7, attention_in_multiplier=0.9, attention_out_multiplier=1.2,
        ssm_multipliers=[0.5, 1.1, 0.9, 1.2, 0.8], ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
    # Gated DeltaNet (2 query/key heads read by 4 value heads, beta in (0, 2)) in pre-norm
    # blocks, and attention with norms over all heads' queries and keys, rotary here (the
    # published checkpoints have none), in blocks whose norms follow their branches.
    "olmo_hybrid": transformers.OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # KDA (2 heads of 16), multi-head latent attention (4 heads, a latent of 16, 4 shared
    # channels that carry no positions), KDA, attention; a SwiGLU MLP in the first layer and
    # DeepSeek-V3's experts after it (4, top 2 among 1 of 2 groups, sigmoid scores with their
    # correction bias, routed scaling, a shared expert).
    "kimi_linear": transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2),
}
# The classes that `AutoModelForCausalLM` does not choose for a config: the image-text models.
MODELS = {"qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
          "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}


# Each float8 fixture: the fixture it quantizes and its blocks (dividing the tiny models' widths).
QUANTIZED = {"qwen3_next_fp8": ("qwen3_next", (8, 8))}


def _noisy(model: torch.nn.Module, seed: int) -> None:
  generator = torch.Generator().manual_seed(seed)
  # The buffers the checkpoint holds as weights: Nemotron-H's expert score corrections.
  weights = [buffer for name, buffer in model.named_buffers()
             if name.endswith("e_score_correction_bias")]
  with torch.no_grad():
    for parameter in [*model.parameters(), *weights]:
      parameter.add_(NOISE * torch.randn(parameter.shape, generator=generator))


def _tokenizer() -> tokenizers.Tokenizer:
  words = ["<pad>", "<s>", "<|endoftext|>", *(f"t{i}" for i in range(3, VOCAB))]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {word: i for i, word in enumerate(words)}, unk_token="<pad>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")
  return tokenizer


def make(name: str, config: transformers.PretrainedConfig, seed: int = 0) -> None:
  torch.manual_seed(seed)
  model = (MODELS[name](config) if name in MODELS
           else transformers.AutoModelForCausalLM.from_config(config)).eval()
  _noisy(model, seed)
  folder = ROOT / name
  folder.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(folder, safe_serialization=True)
  _tokenizer().save(str(folder / "tokenizer.json"))
  _expect(model, folder, seed, 13 if name in SHORT else LENGTH)


def _expect(model: torch.nn.Module, folder: pathlib.Path, seed: int, length: int) -> None:
  """Writes `expected.npz` (the ids, their logits and greedy continuation) and `made_by.json`."""
  ids = np.random.default_rng(seed).integers(3, VOCAB, (BATCH, length))
  with torch.no_grad():
    logits = model(torch.as_tensor(ids)).logits.float().numpy()
    written = model.generate(torch.as_tensor(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             use_cache=False).numpy()
  np.savez(folder / "expected.npz", input_ids=ids.astype(np.int32), logits=logits.astype(np.float32),
           generated=written[:, length:].astype(np.int32))
  versions = {"torch": torch.__version__, "transformers": transformers.__version__, "seed": seed}
  (folder / "made_by.json").write_text(json.dumps(versions, indent=2) + "\n")
  size = sum(f.stat().st_size for f in folder.iterdir())
  print(f"{folder.name}: {size / 1024:.0f} KiB in {folder}")


def make_quantized(name: str, seed: int = 0) -> None:
  """The fixture `QUANTIZED[name]` names, its linear layers' weights quantized by transformers'
  `Fp8Quantize` (float8 e4m3 weights, float32 `weight_scale_inv` per block), the embeddings,
  the head and what does not fill whole blocks left as they are."""
  from transformers.integrations.finegrained_fp8 import Fp8Quantize

  source, block = QUANTIZED[name]
  folder = ROOT / name
  shutil.rmtree(folder, ignore_errors=True)
  shutil.copytree(ROOT / source, folder, ignore=shutil.ignore_patterns("expected.npz", "made_by.json"))
  config = json.loads((folder / "config.json").read_text())
  settings = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
  quantize = Fp8Quantize(types.SimpleNamespace(
      quantization_config=transformers.FineGrainedFP8Config(weight_block_size=block)))
  tensors = {}
  for key, value in load_file(folder / "model.safetensors").items():
    linear = (key.endswith(".weight") and value.ndim == 2 and "embed_tokens" not in key
              and "lm_head" not in key)
    tensors.update(quantize._quantize_one(key, value) if linear else {key: value})
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  config["quantization_config"] = settings
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  assert all(p.dtype == torch.float32 for p in model.parameters()), "not dequantized"
  _expect(model, folder, seed, 13 if source in SHORT else LENGTH)
  print(f"{name}: {sum(v.dtype == torch.float8_e4m3fn for v in tensors.values())} float8 tensors")


if __name__ == "__main__":
  import sys

  for name in sys.argv[1:] or [*CONFIGS, *QUANTIZED]:
    if name in QUANTIZED:
      make_quantized(name)
    else:
      make(name, CONFIGS[name])

"""Architectures of the benchmark's pipelines, by component.

"full" is the published config.json of each model (only the entries that differ from the class
defaults, plus the ones that define the model). "tiny" is the same config with the sizes shrunk;
latent channels, patch sizes, VAE factors and the like stay, so the pipelines take the same code
paths.
"""
from __future__ import annotations

from typing import Any

_KL_VAE = {
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "sample_size": 1024,
}
_T5_XXL = {
    "d_model": 4096,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "d_kv": 64,
    "feed_forward_proj": "gated-gelu",
}

_FULL: dict[str, dict[str, Any]] = {
    # openai/clip-vit-large-patch14 text tower (FLUX, SDXL, SD3).
    "clip_l": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "projection_dim": 768,
        "hidden_act": "quick_gelu",
        "vocab_size": 49408,
    },
    # laion CLIP-ViT-bigG-14 text tower with projection (SDXL, SD3).
    "clip_g": {
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_attention_heads": 20,
        "num_hidden_layers": 32,
        "projection_dim": 1280,
        "hidden_act": "gelu",
        "vocab_size": 49408,
    },
    "t5": {**_T5_XXL, "vocab_size": 32128},  # google/t5-v1_1-xxl encoder (FLUX, SD3)
    "umt5": {**_T5_XXL, "vocab_size": 256384},  # google/umt5-xxl encoder (Wan)
    "flux_transformer": {
        "patch_size": 1,
        "in_channels": 64,  # 16 latent channels, 2x2 patches packed into tokens by the pipeline
        "num_layers": 19,
        "num_single_layers": 38,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,  # T5 width
        "pooled_projection_dim": 768,  # CLIP-L width
        "guidance_embeds": True,
        "axes_dims_rope": (16, 56, 56),
    },
    "flux_vae": {
        **_KL_VAE,
        "latent_channels": 16,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    },
    "sdxl_unet": {
        "sample_size": 128,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "block_out_channels": (320, 640, 1280),
        "layers_per_block": 2,
        "attention_head_dim": (5, 10, 20),
        "transformer_layers_per_block": (1, 2, 10),
        "cross_attention_dim": 2048,  # CLIP-L and CLIP-G hidden states, concatenated
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,  # 6 size/crop numbers x 256 + CLIP-G 1280
    },
    "sdxl_vae": {**_KL_VAE, "latent_channels": 4, "scaling_factor": 0.13025, "force_upcast": True},
    "sd3_transformer": {
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 16,
        "num_layers": 24,
        "attention_head_dim": 64,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,  # T5 width
        "caption_projection_dim": 1536,  # heads x head dim
        "pooled_projection_dim": 2048,  # CLIP-L and CLIP-G projections, concatenated
        "pos_embed_max_size": 192,
    },
    # stable-diffusion-v1-5 (the UNet SD 1.x checkpoints share; its VAE is the KL one, 4 channels).
    "sd15_unet": {
        "sample_size": 64,
        "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        "block_out_channels": (320, 640, 1280, 1280),
        "layers_per_block": 2,
        "attention_head_dim": 8,
        "cross_attention_dim": 768,  # CLIP-L width
    },
    "sd15_vae": {**_KL_VAE, "latent_channels": 4, "scaling_factor": 0.18215, "sample_size": 512},
    "sd3_vae": {
        **_KL_VAE,
        "latent_channels": 16,
        "scaling_factor": 1.5305,
        "shift_factor": 0.0609,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    },
    "wan_transformer": {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,  # UMT5 width
        "freq_dim": 256,
        "ffn_dim": 13824,
        "num_layers": 40,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
    },
    "wan_vae": {
        "base_dim": 96,
        "z_dim": 16,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2,
        "temperal_downsample": [False, True, True],  # sic: diffusers' spelling
    },
}

# Tiny widths, named because the denoisers' text inputs must match the text encoders' outputs.
_TINY_CLIP_WIDTH = 32
_TINY_T5_WIDTH = 64  # SD3 pads the two CLIP widths, concatenated, up to the T5 width
_TINY_VOCAB = 1000  # covers both in-code tokenizers
_TINY_CLIP = {
    "hidden_size": _TINY_CLIP_WIDTH,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,  # SDXL reads the penultimate layer
    "projection_dim": _TINY_CLIP_WIDTH,
    "vocab_size": _TINY_VOCAB,
}
_TINY_T5 = {
    "d_model": _TINY_T5_WIDTH,
    "d_ff": 128,
    "num_layers": 4,  # enough blocks to stream
    "num_heads": 2,
    "d_kv": 32,
    "vocab_size": _TINY_VOCAB,
}
_TINY_KL_VAE = {
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "block_out_channels": (8, 16),
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 32,
}
_TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "clip_l": _TINY_CLIP,
    "clip_g": _TINY_CLIP,
    "t5": _TINY_T5,
    "umt5": _TINY_T5,
    "flux_transformer": {
        # enough blocks of each kind to stream, with a resident prefix and a window of two
        "num_layers": 2,
        "num_single_layers": 4,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": _TINY_T5_WIDTH,
        "pooled_projection_dim": _TINY_CLIP_WIDTH,
        "axes_dims_rope": (4, 6, 6),  # sums to the head dim
    },
    "flux_vae": _TINY_KL_VAE,
    "sdxl_unet": {
        "sample_size": 16,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
        "block_out_channels": (8, 16),
        "layers_per_block": 1,
        "attention_head_dim": (2, 4),
        "transformer_layers_per_block": (1, 1),
        "norm_num_groups": 4,
        "cross_attention_dim": 2 * _TINY_CLIP_WIDTH,
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 6 * 8 + _TINY_CLIP_WIDTH,
    },
    "sdxl_vae": _TINY_KL_VAE,
    "sd15_unet": {
        "sample_size": 16,  # the default size, 16 latents a side: the tiny call's 32 pixels
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "block_out_channels": (8, 16),
        "layers_per_block": 1,
        "attention_head_dim": 2,
        "norm_num_groups": 4,
        "cross_attention_dim": _TINY_CLIP_WIDTH,
    },
    "sd15_vae": _TINY_KL_VAE,
    "sd3_transformer": {
        "sample_size": 16,
        "num_layers": 4,  # enough blocks to stream
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": _TINY_T5_WIDTH,
        "caption_projection_dim": 32,
        "pooled_projection_dim": 2 * _TINY_CLIP_WIDTH,
        "pos_embed_max_size": 16,
    },
    "sd3_vae": _TINY_KL_VAE,
    "wan_transformer": {
        "num_attention_heads": 2,
        "attention_head_dim": 12,  # Wan's RoPE splits a head into thirds of an even size
        "text_dim": _TINY_T5_WIDTH,
        "ffn_dim": 32,
        "num_layers": 4,  # enough blocks to stream
        "rope_max_seq_len": 32,
    },
    "wan_vae": {"base_dim": 8, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1},
}

ARCHITECTURES: dict[str, dict[str, dict[str, Any]]] = {
    "full": _FULL,
    "tiny": {name: {**config, **_TINY_OVERRIDES[name]} for name, config in _FULL.items()},
}

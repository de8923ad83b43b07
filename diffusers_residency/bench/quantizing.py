"""A denoiser quantized in memory for the benchmark's quantized mode (``--quantize nf4``)."""

from __future__ import annotations

import torch


def quantize_nf4(module: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Replace every ``nn.Linear`` of ``module`` by bitsandbytes' NF4 ``Linear4bit``, quantized on the
    device it is on: what diffusers' ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``
    makes of a denoiser, without writing a full-size one to disk and loading it back."""
    import bitsandbytes as bnb

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                quant_type="nf4",
                device="meta",
            )
            weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
            layer.weight = weight.to(child.weight.device)
            layer.bias = child.bias
            setattr(parent, name, layer.eval())

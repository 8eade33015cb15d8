"""Packed attention: transformers' extension point (dispatch.py: our attention function and mask, registered by
name) and the kernels that attend within each packed document (kernels.py: varlen_attn, flex_attention, sdpa per
document). A leaf: it imports nothing else of finetune."""

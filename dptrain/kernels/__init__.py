"""Triton kernels, each with the PyTorch reference it must equal (docs/kernels.md).

The references run by default and on CPU; a kernel is an opt-in performance setting
(``performance.kernels``) that never changes what is computed. A subpackage of dptrain, not a
top-level ``kernels`` package: that name is taken by Hugging Face's kernel hub, which
transformers looks for.
"""

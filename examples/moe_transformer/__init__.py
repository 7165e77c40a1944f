"""A mixture-of-experts transformer whose kernels are sparsegen-generated, trained on a device
mesh: `python -m examples.moe_transformer.train` (see train.py)."""

"""Examples of sparsegen-generated kernels in use (each folder has its own README or docstring)."""

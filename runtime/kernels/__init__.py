"""Hand-written CPU kernels, compiled at first use and cached (see cpu_gemm.py)."""

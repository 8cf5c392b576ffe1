"""The fused SIMD register-tile CPU kernel (``"numba_cpu"``), forward and backward."""

"""The libraries' own fused attention (``"native"``): torch SDPA and JAX's."""

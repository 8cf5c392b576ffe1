"""The Numba CUDA kernels (``"numba_cuda"``): rows, tiled and tensor-core, forward and backward."""

"""GPU kernels (Numba CUDA, CuPy), each beside the NumPy reference its tests compare against."""

"""C kernels compiled once with the system compiler, and their build."""

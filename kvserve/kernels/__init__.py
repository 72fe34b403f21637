"""kvserve's compiled CPU kernels: the C++ sources (`csrc/`), their build (`build`), and one
Python module per `.cpp`, named after it, wrapping its ops for the layers above."""

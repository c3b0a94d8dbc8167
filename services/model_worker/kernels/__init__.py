"""Hand-written kernels, each beside a plain-PyTorch path that the tests compare it with."""

"""One module per op; each registers its kernels with the compile check and the demo."""

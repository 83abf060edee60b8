"""Our own Triton kernels outside attention (MXFP4 expert GEMM). Import lazily: triton is optional on CPU."""

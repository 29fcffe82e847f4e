"""The Triton kernels: decode attention (PQ and paged) with plan/run, PQ encode, block
dequantize, slot writes. They run wherever the router (kernels/router.py) sends an op on
CUDA that the CUDA C++ kernels do not take; Triton is imported only then."""

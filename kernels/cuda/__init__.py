"""The CUDA C++ kernels (NVRTC through CuPy): PQ decode attention with its log-sum-exp
merge, and PQ encode (brute force and cell tables). Sources: common.cuh (device helpers),
attention.cuh / attention.cu, merge.cu, encode.cu; build.py compiles and launches them.
The router (kernels/router.py) sends an op here where cupy imports, the GPU is sm_80 or
newer, and the shapes and dtypes are ones these kernels take."""

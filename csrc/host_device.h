// PAGED_HOST_DEVICE: a function the CUDA kernels and the host code both call (nvcc compiles
// it for both sides; any other compiler sees an inline function).
#pragma once

#if defined(__CUDACC__)
#define PAGED_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PAGED_HOST_DEVICE inline
#endif

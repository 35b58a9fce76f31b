// MOKA_HD marks functions compiled for both host and device (plain C++ shared with CUDA).
#pragma once
#if defined(__CUDACC__)
#define MOKA_HD __host__ __device__ __forceinline__
#else
#define MOKA_HD inline
#endif

// MEMRA_HD marks scalar functions shared by host and device code (DETERMINISM.md rule 7):
// one definition, compiled by g++ for the CPU backend and by nvcc for kernels.
#pragma once

#if defined(__CUDACC__)
#define MEMRA_HD __host__ __device__ __forceinline__
#else
#define MEMRA_HD inline
#endif

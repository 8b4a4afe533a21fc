// Portability macros for code compiled both by the host C++ compiler and by nvcc.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FASTMESH_HOST_DEVICE __host__ __device__
#define FASTMESH_INLINE __forceinline__
#else
#define FASTMESH_HOST_DEVICE
#define FASTMESH_INLINE inline
#endif

// GELU (tanh form) in CUDA C++. Plain CUDA, no torch headers: nvcc compiles it
// anywhere, and perfloop's binding passes raw pointers and the stream.
//
// Why it reaches the copy ceiling where a one-element-per-thread kernel with
// tanhf gets half of it: each thread moves 16 bytes per access (uint4: 4 fp32
// or 8 half), and the tanh is replaced by 0.5x(1+tanh u) = x / (1 + exp(-2u))
// with the hardware exp (__expf): a few instructions instead of tanhf's
// branchy polynomial. kUnroll vectors per thread are loaded before any is
// used; on the H200 one was best (fp32 16384^2: 100.9% of the copy ceiling at 1,
// 97.1-97.5% at 2, 4 and 8; benchmarks/results/2026-11-30-h200-run2.json, "tune").
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float gelu_f(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return __fdividef(x, 1.0f + __expf(-2.0f * u));
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr int kThreads = 256;

// Vector body: n_vec 16-byte vectors; each thread takes kUnroll of them, strided
// by the block so a warp's accesses stay contiguous (coalesced).
template <typename T, int kUnroll>
__global__ void __launch_bounds__(kThreads) gelu_vec_kernel(const uint4* __restrict__ x, uint4* __restrict__ y, int64_t n_vec) {
  constexpr int kPer = 16 / sizeof(T);
  const int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
  uint4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight
    const int64_t i = base + (int64_t)u * kThreads;
    if (i < n_vec) v[u] = __ldg(x + i);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + (int64_t)u * kThreads;
    if (i < n_vec) {
      T* e = reinterpret_cast<T*>(&v[u]);
#pragma unroll
      for (int k = 0; k < kPer; ++k) e[k] = from_f<T>(gelu_f(to_f(e[k])));
      y[i] = v[u];
    }
  }
}

// Scalar path: the tail after the last whole vector, or unaligned pointers.
template <typename T>
__global__ void gelu_scalar_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t start, int64_t n) {
  const int64_t i = start + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = from_f<T>(gelu_f(to_f(x[i])));
}

template <typename T, int kUnroll>
int launch(const void* x, void* y, int64_t n, cudaStream_t stream) {
  constexpr int kPer = 16 / sizeof(T);
  const bool aligned = ((uintptr_t)x % 16 == 0) && ((uintptr_t)y % 16 == 0);
  const int64_t n_vec = aligned ? n / kPer : 0;
  if (n_vec > 0) {
    const int64_t blocks = (n_vec + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    gelu_vec_kernel<T, kUnroll><<<(unsigned)blocks, kThreads, 0, stream>>>(
        static_cast<const uint4*>(x), static_cast<uint4*>(y), n_vec);
  }
  const int64_t start = n_vec * kPer;
  if (start < n) {
    const int64_t rest = n - start;
    gelu_scalar_kernel<T><<<(unsigned)((rest + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), start, n);
  }
  return (int)cudaGetLastError();
}

}  // namespace

template <typename T>
int launch_unrolled(const void* x, void* y, int64_t n, int unroll, cudaStream_t s) {
  switch (unroll) {
    case 1: return launch<T, 1>(x, y, n, s);
    case 2: return launch<T, 2>(x, y, n, s);
    case 4: return launch<T, 4>(x, y, n, s);
    case 8: return launch<T, 8>(x, y, n, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

// dtype: 0 = float32, 1 = float16, 2 = bfloat16; unroll: 16-byte vectors per
// thread (1, 2, 4 or 8). Returns a cudaError_t.
extern "C" int perfloop_gelu(const void* x, void* y, int64_t n, int dtype, int unroll, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_unrolled<float>(x, y, n, unroll, s);
    case 1: return launch_unrolled<__half>(x, y, n, unroll, s);
    case 2: return launch_unrolled<__nv_bfloat16>(x, y, n, unroll, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

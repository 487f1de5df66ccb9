#include <cstdint>
__global__ void add_one(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }
template <typename T> __global__ void scale(T* x, T s, int n) { int i = threadIdx.x; if (i < n) x[i] *= s; }
template __global__ void scale<float>(float*, float, int);
template __global__ void scale<double>(double*, double, int);
namespace vllm { __global__ void rms_norm_kernel(float* o, const float* i, int n) { o[threadIdx.x] = i[threadIdx.x] * 0.5f; } }
extern "C" void launch(float* x, int n) { add_one<<<1, 32>>>(x, n); }

// A second family of kernels: the promise tests give it other code than kernels.cu's.
namespace vllm { __global__ void extra_kernel(float* x, int n) { if (threadIdx.x < n) x[threadIdx.x] -= 1.0f; } }

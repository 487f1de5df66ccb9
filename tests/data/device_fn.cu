// A kernel that calls a device function nvcc keeps out of line: the cubin's symbol table
// then holds a FUNC symbol without the kernel (ENTRY) bit, which is not a kernel.
__device__ __noinline__ float twice(float x) { return 2.0f * x; }

__global__ void uses_twice(float* data, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] = twice(data[i]);
}

// flash-attention-shaped kernels for sm121-build's tests (sm_80 instructions: cp.async).
namespace flash {
template <int kHeadDim>
__global__ void flash_fwd_kernel(float* out, const float* q, int n) {
  __shared__ float tile[kHeadDim];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x < kHeadDim && i < n) {
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(&tile[threadIdx.x]));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(dst), "l"(q + i));
    asm volatile("cp.async.wait_all;\n" ::);
  }
  __syncthreads();
  if (i < n) out[i] = tile[threadIdx.x % kHeadDim] * 0.125f;
}
template __global__ void flash_fwd_kernel<128>(float*, const float*, int);
}  // namespace flash
extern "C" void fa_like_fwd_hdim128(float* o, const float* q, int n) {
  flash::flash_fwd_kernel<128><<<(n + 63) / 128, 128>>>(o, q, n);
}

namespace vllm {
__global__ void rms_norm_kernel(float* out, const float* in, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * 0.5f;
}
__global__ void silu_and_mul_kernel(float* out, const float* a, const float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] / (1.0f + __expf(-a[i])) * b[i];
}
}  // namespace vllm
extern "C" void vllm_like_rms_norm(float* o, const float* i, int n) {
  vllm::rms_norm_kernel<<<(n + 255) / 256, 256>>>(o, i, n);
}

namespace vllm { namespace moe {
__global__ void topk_softmax_kernel(float* out, const float* logits, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __expf(logits[i]);
}
}}  // namespace vllm::moe
extern "C" void vllm_like_topk(float* o, const float* l, int n) {
  vllm::moe::topk_softmax_kernel<<<(n + 255) / 256, 256>>>(o, l, n);
}

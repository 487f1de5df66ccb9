// A kernel written for one GPU's instructions, as CUTLASS writes its sm_90a GEMMs: the real
// body only where the arch matches, elsewhere a stub that traps (a few instructions).
namespace vllm {
__global__ void sm90_only_kernel(float* x, const float* w, int n) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || defined(REAL_EVERYWHERE))
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 192; ++i) acc += x[(threadIdx.x * 7 + i * 37) % n] * w[i] + acc * 0.5f;
  x[threadIdx.x] = acc;
#else
  __trap();
#endif
}
}

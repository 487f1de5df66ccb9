// Enough device code for a .nv_fatbin of several 64 KiB pages (the aot tests' cut path).
template <int N> __global__ void unrolled(float* x, const float* y) {
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) acc = acc * y[(threadIdx.x + i * 7) & 255] + __sinf(acc + i);
  x[threadIdx.x] = acc;
}
template __global__ void unrolled<256>(float*, const float*);
template __global__ void unrolled<512>(float*, const float*);
template __global__ void unrolled<768>(float*, const float*);
template __global__ void unrolled<1024>(float*, const float*);

// Translation unit B of the two-TU fixture (built for sm_90 only in the test).
template <int N> __global__ void shared_kernel(float* out) { out[threadIdx.x] = N; }
__global__ void only_b_kernel(float* out) { out[threadIdx.x] = 2.0f; }
extern "C" void launch_b(float* out) {
  shared_kernel<1><<<1, 32>>>(out);
  only_b_kernel<<<1, 32>>>(out);
}

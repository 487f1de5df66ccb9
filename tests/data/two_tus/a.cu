// Translation unit A of the two-TU fixture (built for sm_121 in the test).
template <int N> __global__ void shared_kernel(float* out) { out[threadIdx.x] = N; }
__global__ void only_a_kernel(float* out) { out[threadIdx.x] = 1.0f; }
extern "C" void launch_a(float* out) {
  shared_kernel<1><<<1, 32>>>(out);
  only_a_kernel<<<1, 32>>>(out);
}

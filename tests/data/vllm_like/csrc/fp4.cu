// Uses the FP4 conversion that ptxas accepts for sm_121a / sm_120f but rejects for sm_121.
__global__ void fp4_pack(unsigned short* out, const float* in, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    unsigned short packed;
    asm volatile("{\n .reg .b8 b;\n cvt.rn.satfinite.e2m1x2.f32 b, %1, %2;\n mov.b16 %0, {b, 0};\n}"
                 : "=h"(packed) : "f"(in[2 * i]), "f"(in[2 * i + 1]));
    out[i] = packed;
  }
}

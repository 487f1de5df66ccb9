// vLLM's Marlin GEMM kernel as csrc/quantization/marlin/marlin_template.h declares it (0.20
// to 0.22: twelve template arguments, four of them vllm::ScalarType ids), with an empty body:
// a name `prove` derives marlin_gemm cases from (tests/unit/test_marlin_kernels.py)
#pragma once
#include <cuda_runtime.h>
#define MARLIN_KERNEL_PARAMS                                                              \
  const int4 *__restrict__ A, const int4 *__restrict__ B, int4 *__restrict__ C,          \
      int4 *__restrict__ C_tmp, const int4 *__restrict__ b_bias_ptr,                     \
      const float *__restrict__ a_scales_ptr, const int4 *__restrict__ scales_ptr,       \
      const float *__restrict__ global_scale_ptr, const int4 *__restrict__ zp_ptr,       \
      const int *__restrict__ g_idx, int num_groups, int prob_m, int prob_n, int prob_k, \
      int lda, int *locks, bool has_bias, bool use_atomic_add, bool use_fp32_reduce,     \
      int max_shared_mem
namespace marlin {
template <long a_type_id, long b_type_id, long c_type_id, long s_type_id, int threads,
          int thread_m_blocks, int thread_n_blocks, int thread_k_blocks, bool m_block_size_8,
          int stages, int group_blocks, bool is_zp_float>
__global__ void Marlin(MARLIN_KERNEL_PARAMS) {}
}  // namespace marlin

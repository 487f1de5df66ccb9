// vLLM FA2 names (split-KV and its combine kernel, a module of their own): one derived case
// (num_splits 4) of this module.
#include "fa2_names.cuh"
namespace flash {
using S128 = Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>;
template __global__ void flash_fwd_splitkv_kernel<S128, false, false, false, false, true, false, true, false>(Flash_fwd_params);
template __global__ void flash_fwd_splitkv_combine_kernel<S128, 4, 2, true>(Flash_fwd_params);
}

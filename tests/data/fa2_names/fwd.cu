// vLLM FA2 names (flash_fwd_kernel, its own translation unit as in flash-attention): the
// derivation on a GB10 gives two cases (ALiBi; local) of this module.
#include "fa2_names.cuh"
namespace flash {
using T128 = Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>;
template __global__ void flash_fwd_kernel<T128, false, false, false, true, false, false, false, false>(Flash_fwd_params);
template __global__ void flash_fwd_kernel<T128, false, false, true, false, false, true, false, false>(Flash_fwd_params);
}

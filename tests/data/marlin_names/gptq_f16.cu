// Marlin<half, uint4b8, half, half, ...> (GPTQ 4-bit), its own translation unit as
// generate_kernels.py writes it: three shapes the dispatch picks (on any GPU of the table),
// and one it never picks (128 threads, 64 x 128 tile, one M block, groups of 128: the
// 128 x 128 tile is valid wherever it is)
#include "marlin_names.cuh"
namespace marlin {
template __global__ void Marlin<1125899906910725L, 1125899907892224L, 1125899906910725L, 1125899906910725L, 256, 1, 8, 8, false, 4, -1, false>(MARLIN_KERNEL_PARAMS);
template __global__ void Marlin<1125899906910725L, 1125899907892224L, 1125899906910725L, 1125899906910725L, 128, 1, 4, 8, true, 4, -1, false>(MARLIN_KERNEL_PARAMS);
template __global__ void Marlin<1125899906910725L, 1125899907892224L, 1125899906910725L, 1125899906910725L, 256, 4, 16, 4, false, 4, 8, false>(MARLIN_KERNEL_PARAMS);
template __global__ void Marlin<1125899906910725L, 1125899907892224L, 1125899906910725L, 1125899906910725L, 128, 1, 8, 4, false, 4, 8, false>(MARLIN_KERNEL_PARAMS);
}

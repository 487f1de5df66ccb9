// Marlin<int8, uint4, half, half, ...> (AWQ 4-bit with an 8-bit activation): two shapes
#include "marlin_names.cuh"
namespace marlin {
template __global__ void Marlin<1125899906909952L, 1125899906843648L, 1125899906910725L, 1125899906910725L, 256, 1, 8, 8, false, 4, -1, false>(MARLIN_KERNEL_PARAMS);
template __global__ void Marlin<1125899906909952L, 1125899906843648L, 1125899906910725L, 1125899906910725L, 256, 2, 16, 4, false, 4, 4, false>(MARLIN_KERNEL_PARAMS);
}

// Only the names of vLLM FA2's kernels (flash-attention's templates, empty bodies): what
// `prove`'s derivation reads.  Nothing here computes attention.
namespace cutlass { struct bfloat16_t { unsigned short x; }; struct half_t { unsigned short x; }; }
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename elem_type>
struct Flash_kernel_traits {};
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool Is_Q_in_regs_,
          bool Share_Q_K_smem_, typename elem_type,
          typename Base = Flash_kernel_traits<kHeadDim_, kBlockM_, kBlockN_, kNWarps_, elem_type>>
struct Flash_fwd_kernel_traits : public Base {};
namespace flash {
struct Flash_fwd_params { int x; };
template <typename Kernel_traits, bool Is_dropout, bool Is_causal, bool Is_local, bool Has_alibi,
          bool Is_even_MN, bool Is_even_K, bool Is_softcap, bool Return_softmax>
__global__ void flash_fwd_kernel(Flash_fwd_params params) {}
template <typename Kernel_traits, bool Is_causal, bool Is_local, bool Has_alibi, bool Is_even_MN,
          bool Is_even_K, bool Is_softcap, bool Split, bool Append_KV>
__global__ void flash_fwd_splitkv_kernel(Flash_fwd_params params) {}
template <typename Kernel_traits, int kBlockM, int Log_max_splits, bool Is_even_K>
__global__ void flash_fwd_splitkv_combine_kernel(Flash_fwd_params params) {}
}  // namespace flash

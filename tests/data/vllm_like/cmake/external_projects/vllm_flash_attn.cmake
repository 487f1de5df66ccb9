# The shape of vLLM's cmake/external_projects/vllm_flash_attn.cmake: flash-attention from
# VLLM_FLASH_ATTN_SRC_DIR, else fetched at GIT_TAG.  The test fixture fills in the two
# placeholders with a local git repository of tests/data/fa_like and its commit.
include(FetchContent)
if (DEFINED ENV{VLLM_FLASH_ATTN_SRC_DIR})
  set(VLLM_FLASH_ATTN_SRC_DIR $ENV{VLLM_FLASH_ATTN_SRC_DIR})
endif()

if(VLLM_FLASH_ATTN_SRC_DIR)
  FetchContent_Declare(
          vllm-flash-attn SOURCE_DIR
          ${VLLM_FLASH_ATTN_SRC_DIR}
          BINARY_DIR ${CMAKE_BINARY_DIR}/vllm-flash-attn
  )
else()
  FetchContent_Declare(
          vllm-flash-attn
          GIT_REPOSITORY @FA_GIT_REPOSITORY@
          GIT_TAG @FA_GIT_TAG@
          GIT_PROGRESS TRUE
          BINARY_DIR ${CMAKE_BINARY_DIR}/vllm-flash-attn
  )
endif()
FetchContent_MakeAvailable(vllm-flash-attn)

// Layer 2's host half: turns a validated kvb_page_copy_desc into the kernel's PageCopyParams
// and grid size. Plain C++ (no CUDA), so it is built and tested without a GPU.
#ifndef KVBRIDGE_KERNELS_CUDA_PAGE_COPY_PARAMS_H_
#define KVBRIDGE_KERNELS_CUDA_PAGE_COPY_PARAMS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/page_copy_kernel.cuh"
#include "kvbridge/kernels/page_copy.h"

namespace kvb_kernels::cuda {

// REQUIRES: kvb_page_copy_validate(desc) passed and desc.n_pages > 0. Fails (naming the
// field) when a side's table has a NULL host entry, or when the host tables that must travel
// inline exceed kMaxInlinePtrs entries.
int BuildPageCopyParams(const kvb_page_copy_desc& desc, PageCopyParams* params,
                        int64_t* grid_blocks, char* err, size_t err_len);

}  // namespace kvb_kernels::cuda

#endif  // KVBRIDGE_KERNELS_CUDA_PAGE_COPY_PARAMS_H_

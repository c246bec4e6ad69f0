// Bindings of the page-copy kernels (kernels/include/kvbridge/kernels/page_copy.h). The torch
// ops in python/kvbridge/ops.py build Sides from tensors' pointers, shapes and strides and call
// page_copy; nothing here knows torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "bindings/common.h"
#include "kvbridge/kernels/page_copy.h"

namespace kvbridge::bindings {
namespace {

// A kvb_page_side with its geometry, owning the host pointer table the side points at.
struct Side {
  kvb_page_side side{};
  kvb_page_geometry geometry{};
  std::vector<void*> layer_ptrs;
};

// The kernels' code travels in the exception's type; their own status name is kept in the
// message only where several kernel codes share one kvbridge code.
[[noreturn]] void ThrowKernel(int rc, const char* err) {
  std::string msg = std::string(kvb_kernel_status_name(rc)) + ": " + err;
  switch (rc) {
    case KVB_KERNEL_ERR_INVALID_ARGUMENT:
      throw StatusError(Status::InvalidArgument(err));
    case KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE:
      throw StatusError(Status::OutOfBounds(err));
    case KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA:
    case KVB_KERNEL_ERR_NO_CUDA_DEVICE:
      throw StatusError(Status::Unavailable(msg));
    default:
      throw StatusError(Status::Internal(msg));
  }
}

void Check(int rc, const char* err) {
  if (rc != KVB_KERNEL_OK) ThrowKernel(rc, err);
}

void* Ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// Points side.layer_ptrs at the owned table (after the Side has reached its final address).
void SetTable(Side& s, const std::vector<uintptr_t>& ptrs) {
  s.layer_ptrs.clear();
  for (uintptr_t p : ptrs) s.layer_ptrs.push_back(Ptr(p));
}

void BindSide(py::module_& m) {
  py::class_<Side>(m, "PageSide", "One side of a page copy (kvb_page_side + geometry).")
      .def_property_readonly("geometry",
                             [](const Side& s) {
                               return py::make_tuple(s.geometry.n_layers, s.geometry.n_kv,
                                                     s.geometry.rows, s.geometry.row_bytes);
                             })
      .def_property_readonly("num_pages", [](const Side& s) { return s.side.num_pages; })
      .def("select_layer", [](const Side& s, int64_t layer) {
        Side out = s;
        out.side.layer_ptrs = out.layer_ptrs.empty() ? nullptr : out.layer_ptrs.data();
        char err[256] = "";
        Check(kvb_page_side_select_layer(&out.side, layer, s.geometry.n_layers, err, sizeof err),
              err);
        // The C call advanced the table pointer (and the device table's) by `layer`; drop as
        // many entries from our copy of the table so its start is the selected layer.
        if (!out.layer_ptrs.empty()) {
          ptrdiff_t off = out.side.layer_ptrs - const_cast<void* const*>(out.layer_ptrs.data());
          out.layer_ptrs.erase(out.layer_ptrs.begin(), out.layer_ptrs.begin() + off);
          out.side.layer_ptrs = nullptr;  // re-pointed at copy time (the Side may move)
        }
        out.geometry.n_layers = 1;
        return out;
      });
}

}  // namespace

void BindKernels(py::module_& m) {
  BindSide(m);

  m.def(
      "sglang_host_side",
      [](int layout, uintptr_t base, int64_t n_layers, int64_t n_kv, int64_t total_slots,
         int64_t page_size, int64_t row_bytes) {
        Side s;
        char err[256] = "";
        Check(kvb_sglang_host_side(&s.side, &s.geometry, static_cast<kvb_sglang_layout>(layout),
                                   Ptr(base), n_layers, n_kv, total_slots, page_size, row_bytes,
                                   err, sizeof err),
              err);
        return s;
      },
      py::arg("layout"), py::arg("base"), py::arg("n_layers"), py::arg("n_kv"),
      py::arg("total_slots"), py::arg("page_size"), py::arg("row_bytes"));

  m.def(
      "sglang_device_side",
      [](const std::vector<uintptr_t>& layer_ptrs, uintptr_t layer_ptrs_device, int64_t n_layers,
         int64_t n_kv, int64_t total_slots, int64_t page_size, int64_t row_bytes) {
        Side s;
        SetTable(s, layer_ptrs);
        char err[256] = "";
        Check(kvb_sglang_device_side(&s.side, &s.geometry, s.layer_ptrs.data(),
                                     reinterpret_cast<void* const*>(layer_ptrs_device), n_layers,
                                     n_kv, total_slots, page_size, row_bytes, err, sizeof err),
              err);
        s.side.layer_ptrs = nullptr;  // re-pointed at copy time (the Side may move)
        return s;
      },
      py::arg("layer_ptrs"), py::arg("layer_ptrs_device"), py::arg("n_layers"), py::arg("n_kv"),
      py::arg("total_slots"), py::arg("page_size"), py::arg("row_bytes"));

  m.def(
      "vllm_block_side",
      [](const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t elem_bytes,
         int block_dim, int kv_dim, int layer_dim, uintptr_t base,
         const std::vector<uintptr_t>& layer_ptrs, uintptr_t layer_ptrs_device, int64_t n_layers) {
        if (shape.size() != strides.size() || shape.empty() || shape.size() > KVB_MAX_DIMS) {
          throw StatusError(Status::InvalidArgument(
              "shape and strides must have the same length, 1.." + std::to_string(KVB_MAX_DIMS)));
        }
        kvb_vllm_kv_tensor t{};
        t.ndim = static_cast<int>(shape.size());
        for (size_t i = 0; i < shape.size(); ++i) {
          t.shape[i] = shape[i];
          t.strides[i] = strides[i];
        }
        t.elem_bytes = elem_bytes;
        t.block_dim = block_dim;
        t.kv_dim = kv_dim;
        t.layer_dim = layer_dim;
        Side s;
        SetTable(s, layer_ptrs);
        char err[256] = "";
        Check(kvb_vllm_block_side(&s.side, &s.geometry, &t, Ptr(base),
                                  s.layer_ptrs.empty() ? nullptr : s.layer_ptrs.data(),
                                  reinterpret_cast<void* const*>(layer_ptrs_device), n_layers, err,
                                  sizeof err),
              err);
        s.side.layer_ptrs = nullptr;
        return s;
      },
      py::arg("shape"), py::arg("strides"), py::arg("elem_bytes"), py::arg("block_dim"),
      py::arg("kv_dim"), py::arg("layer_dim"), py::arg("base"), py::arg("layer_ptrs"),
      py::arg("layer_ptrs_device"), py::arg("n_layers"));

  m.def(
      "page_buffer_side",
      [](const std::tuple<int64_t, int64_t, int64_t, int64_t>& geometry, uintptr_t base,
         int64_t num_pages) {
        Side s;
        s.geometry = {std::get<0>(geometry), std::get<1>(geometry), std::get<2>(geometry),
                      std::get<3>(geometry)};
        char err[256] = "";
        Check(kvb_page_buffer_side(&s.side, &s.geometry, Ptr(base), num_pages, err, sizeof err),
              err);
        return s;
      },
      py::arg("geometry"), py::arg("base"), py::arg("num_pages"));

  m.def(
      "page_copy",
      [](Side src, Side dst, uintptr_t src_pages, uintptr_t dst_pages, int64_t n_pages, bool cuda,
         uintptr_t stream, int num_threads) {
        src.side.layer_ptrs = src.layer_ptrs.empty() ? nullptr : src.layer_ptrs.data();
        dst.side.layer_ptrs = dst.layer_ptrs.empty() ? nullptr : dst.layer_ptrs.data();
        kvb_page_copy_desc desc{};
        char err[256] = "";
        Check(kvb_page_copy_desc_init(&desc, &src.side, &src.geometry, &dst.side, &dst.geometry,
                                      reinterpret_cast<const int64_t*>(src_pages),
                                      reinterpret_cast<const int64_t*>(dst_pages), n_pages, err,
                                      sizeof err),
              err);
        int rc;
        {
          py::gil_scoped_release release;
          rc = cuda ? kvb_page_copy_cuda(&desc, Ptr(stream), err, sizeof err)
                    : kvb_page_copy_cpu(&desc, num_threads, err, sizeof err);
        }
        Check(rc, err);
      },
      py::arg("src"), py::arg("dst"), py::arg("src_pages"), py::arg("dst_pages"),
      py::arg("n_pages"), py::arg("cuda"), py::arg("stream") = 0, py::arg("num_threads") = 0);

  m.def(
      "sglang_slots_to_pages",
      [](uintptr_t slots, int64_t n_slots, int64_t page_size, uintptr_t pages) {
        char err[256] = "";
        Check(kvb_sglang_slots_to_pages(reinterpret_cast<const int64_t*>(slots), n_slots, page_size,
                                        reinterpret_cast<int64_t*>(pages), err, sizeof err),
              err);
      },
      py::arg("slots"), py::arg("n_slots"), py::arg("page_size"), py::arg("pages"));

  // (usable, reason): whether kvb_page_copy_cuda can run in this process.
  m.def("cuda_kernels_available", [] {
    kvb_page_copy_desc desc{};
    char err[256] = "";
    int rc = kvb_page_copy_cuda(&desc, nullptr, err, sizeof err);
    bool usable = rc != KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA && rc != KVB_KERNEL_ERR_NO_CUDA_DEVICE;
    return py::make_tuple(usable, usable ? std::string() : std::string(err));
  });
  m.attr("SGLANG_LAYER_FIRST") = static_cast<int>(KVB_SGLANG_LAYER_FIRST);
  m.attr("SGLANG_PAGE_FIRST") = static_cast<int>(KVB_SGLANG_PAGE_FIRST);
  m.attr("SGLANG_PAGE_FIRST_DIRECT") = static_cast<int>(KVB_SGLANG_PAGE_FIRST_DIRECT);
  m.attr("KV_DIM_NONE") = KVB_KV_DIM_NONE;
  m.attr("KV_DIM_PACKED_LAST") = KVB_KV_DIM_PACKED_LAST;
  m.attr("LAYER_DIM_NONE") = KVB_LAYER_DIM_NONE;
  m.attr("CUDA_INLINE_PTRS") = KVB_PAGE_COPY_CUDA_INLINE_PTRS;
}

}  // namespace kvbridge::bindings

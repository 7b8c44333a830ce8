// PyTorch ops over expert parallelism's exchange kernels (docs/OPS.md): pull_rows copies the rows
// each peer's staging buffer holds for this rank, every count read on the device; sum_blocks adds
// a reduce-scatter's received blocks in one pass.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "bindings/common.hpp"
#include "machmoe/pull_rows.hpp"
#include "machmoe/sum_blocks.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

// peers [W] int64: each peer's staging base address -> out [out_rows, row_bytes] uint8 (rows past
// those that arrived unwritten). See machmoe/pull_rows.hpp for the staging layout and the rules.
Tensor op_pull_rows(const Tensor& peers, int64_t header_offset, int64_t rows_offset, int64_t src_rows,
                    int64_t rank, int64_t out_rows, int64_t row_bytes) {
  return translate_errors([&] {
    check_dims(peers, "peers", 1);
    check_tensor(peers, "peers", at::kLong, peers.sizes());
    MACHMOE_CHECK_VALUE(out_rows >= 0 && row_bytes >= 0, "out_rows and row_bytes must be >= 0, got ", out_rows,
                        " and ", row_bytes);
    const c10::cuda::CUDAGuard guard(peers.device());
    Tensor out = at::empty({out_rows, row_bytes}, peers.options().dtype(at::kByte));
    PullRowsArgs a;
    a.peers = peers.data_ptr<int64_t>();
    a.W = peers.numel();
    a.rank = rank;
    a.header_offset = header_offset;
    a.rows_offset = rows_offset;
    a.src_rows = src_rows;
    a.row_bytes = row_bytes;
    a.out = out.data_ptr();
    a.out_rows = out_rows;
    pull_rows(a, at::cuda::getCurrentCUDAStream());
    return out;
  });
}

// parts: count tensors of one shape, bf16 or float32, contiguous, on one CUDA device -> their sum
// (float32 in list order, rounded once to their dtype) as a new tensor of that shape.
Tensor op_sum_blocks(at::TensorList parts) {
  return translate_errors([&] {
    MACHMOE_CHECK_VALUE(!parts.empty(), "parts must hold at least one tensor");
    const Tensor& first = parts[0];
    MACHMOE_CHECK_VALUE(first.scalar_type() == at::kBFloat16 || first.scalar_type() == at::kFloat,
                        "parts must be bfloat16 or float32, got ", first.scalar_type());
    const at::Device device = first.device();
    std::vector<const void*> ptrs;
    for (size_t q = 0; q < parts.size(); ++q) {
      const std::string name = "parts[" + std::to_string(q) + "]";
      check_tensor(parts[q], name.c_str(), first.scalar_type(), first.sizes(), &device);
      ptrs.push_back(parts[q].data_ptr());
    }
    const c10::cuda::CUDAGuard guard(device);
    Tensor out = at::empty_like(first, at::MemoryFormat::Contiguous);
    SumBlocksArgs a;
    a.parts = ptrs.data();
    a.count = static_cast<int64_t>(ptrs.size());
    a.elems = first.numel();
    a.dtype = first.scalar_type() == at::kBFloat16 ? DType::BF16 : DType::FP32;
    a.out = out.data_ptr();
    sum_blocks(a, at::cuda::getCurrentCUDAStream());
    return out;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("pull_rows(Tensor peers, int header_offset, int rows_offset, int src_rows, int rank, int out_rows,"
        " int row_bytes) -> Tensor");
  m.def("sum_blocks(Tensor[] parts) -> Tensor");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("pull_rows", &op_pull_rows);
  m.impl("sum_blocks", &op_sum_blocks);
}

}  // namespace machmoe::bindings

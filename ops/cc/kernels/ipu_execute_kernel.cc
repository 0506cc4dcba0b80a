// CPU kernel of IpuExecute: hands a step's tensors to the tf_ipu host runtime.
//
//   Keras traced function (tf.function graph, or eager)
//     --> IpuExecute kernel (this file: allocates outputs, calls the callbacks)
//       --> ctypes trampolines (tf_ipu_ops.set_device_handler)
//         --> tf_ipu runtime (Python) --gRPC--> device server --> emulated IPUs
//
// The runtime installs two C callbacks with tf_ipu_set_device_callbacks() (see
// ipu_device_callbacks.h). Each kernel instance registers its program once, lazily, on its
// first Compute, and again only if the callbacks are replaced. Buffers cross the boundary
// as raw pointers: no copy on this side.
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "ops/cc/kernels/ipu_device_callbacks.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tf_ipu {
namespace {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::PartialTensorShape;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

// Size of the buffer the callbacks write their error message into.
constexpr size_t kErrLen = 4096;

// The installed callbacks. `generation` changes on every install, so kernels know when
// their cached program id belongs to an earlier runtime.
struct Callbacks {
  tf_ipu_register_fn register_fn = nullptr;
  tf_ipu_execute_fn execute_fn = nullptr;
  uint64_t generation = 0;
};

std::mutex g_callbacks_mu;
Callbacks g_callbacks;  // Guarded by g_callbacks_mu.

Callbacks CurrentCallbacks() {
  std::lock_guard<std::mutex> lock(g_callbacks_mu);
  return g_callbacks;
}

// Dtypes whose buffers are plain arrays of fixed-size elements the runtime can view.
bool IsSupportedDtype(DataType dt) {
  switch (dt) {
    case tensorflow::DT_HALF:
    case tensorflow::DT_BFLOAT16:
    case tensorflow::DT_FLOAT:
    case tensorflow::DT_DOUBLE:
    case tensorflow::DT_INT8:
    case tensorflow::DT_INT16:
    case tensorflow::DT_INT32:
    case tensorflow::DT_INT64:
    case tensorflow::DT_UINT8:
    case tensorflow::DT_UINT16:
    case tensorflow::DT_UINT32:
    case tensorflow::DT_UINT64:
    case tensorflow::DT_BOOL:
    case tensorflow::DT_COMPLEX64:
    case tensorflow::DT_COMPLEX128:
      return true;
    default:
      return false;
  }
}

// A status from a callback's code and message; unknown codes become INTERNAL.
absl::Status StatusFromCallback(int64_t code, const char* err, absl::string_view what) {
  std::string message = absl::StrCat("IpuExecute: ", what, ": ",
                                     err[0] != '\0' ? err : "(no message from the runtime)");
  if (code < 1 || code > 16) {
    absl::StrAppend(&message, " (unknown status code ", code, " from the tf_ipu runtime)");
    return absl::InternalError(message);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

// Appends a tensor's dtype, rank and dims to the flat arrays the callbacks take.
template <typename Vec32, typename Vec64>
void AppendLayout(DataType dt, const TensorShape& shape, Vec32* dtypes, Vec32* ranks,
                  Vec64* dims) {
  dtypes->push_back(static_cast<int>(dt));
  ranks->push_back(shape.dims());
  for (int d = 0; d < shape.dims(); ++d) dims->push_back(shape.dim_size(d));
}

class IpuExecuteOp : public OpKernel {
 public:
  explicit IpuExecuteOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("program", &program_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("signature", &signature_));
    std::vector<PartialTensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("output_shapes", &shapes));
    OP_REQUIRES(ctx, static_cast<int>(shapes.size()) == ctx->num_outputs(),
                absl::InvalidArgumentError(absl::StrCat(
                    "IpuExecute needs one output shape per output. Received: ", shapes.size(),
                    " output_shapes for ", ctx->num_outputs(), " outputs (Tout).")));
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const DataType dt = ctx->input_type(i);
      OP_REQUIRES(ctx, IsSupportedDtype(dt),
                  absl::InvalidArgumentError(absl::StrCat(
                      "IpuExecute cannot send input ", i, " of dtype ", DataTypeString(dt),
                      " to the IPU: only numeric and bool tensors cross to the device "
                      "(no string, variant or resource tensors).")));
    }
    for (int i = 0; i < ctx->num_outputs(); ++i) {
      const DataType dt = ctx->output_type(i);
      OP_REQUIRES(ctx, IsSupportedDtype(dt),
                  absl::InvalidArgumentError(absl::StrCat(
                      "IpuExecute cannot return output ", i, " of dtype ", DataTypeString(dt),
                      " from the IPU: only numeric and bool tensors cross from the device "
                      "(no string, variant or resource tensors).")));
      TensorShape shape;
      OP_REQUIRES(ctx, shapes[i].AsTensorShape(&shape),
                  absl::InvalidArgumentError(absl::StrCat(
                      "IpuExecute allocates its outputs before the device runs, so every "
                      "output shape must be fully defined. Received: output_shapes[",
                      i, "]=", shapes[i].DebugString())));
      output_shapes_.push_back(shape);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Callbacks callbacks = CurrentCallbacks();
    OP_REQUIRES(ctx, callbacks.execute_fn != nullptr,
                absl::FailedPreconditionError(
                    "IpuExecute: the tf_ipu device runtime is not loaded in this process, so "
                    "there is no IPU to run this program on. `import tf_ipu` (which loads the "
                    "runtime and registers it with the op library) before running this "
                    "graph or SavedModel."));
    int64_t program_id = -1;
    OP_REQUIRES_OK(ctx, ProgramId(callbacks, &program_id));

    const int n_in = ctx->num_inputs();
    const int n_out = ctx->num_outputs();
    absl::InlinedVector<const void*, 8> in_ptrs;
    absl::InlinedVector<int, 8> in_dtypes, in_ranks;
    absl::InlinedVector<int64_t, 32> in_dims;
    for (int i = 0; i < n_in; ++i) {
      const Tensor& t = ctx->input(i);
      in_ptrs.push_back(t.data());
      AppendLayout(t.dtype(), t.shape(), &in_dtypes, &in_ranks, &in_dims);
    }
    absl::InlinedVector<void*, 8> out_ptrs;
    absl::InlinedVector<int, 8> out_dtypes, out_ranks;
    absl::InlinedVector<int64_t, 32> out_dims;
    for (int i = 0; i < n_out; ++i) {
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, output_shapes_[i], &t));
      out_ptrs.push_back(t->data());
      AppendLayout(t->dtype(), t->shape(), &out_dtypes, &out_ranks, &out_dims);
    }

    char err[kErrLen];
    err[0] = '\0';
    const int code = callbacks.execute_fn(
        program_id, n_in, in_ptrs.data(), in_dtypes.data(), in_ranks.data(), in_dims.data(),
        n_out, out_ptrs.data(), out_dtypes.data(), out_ranks.data(), out_dims.data(), err,
        kErrLen);
    err[kErrLen - 1] = '\0';
    if (code != 0) {
      ctx->SetStatus(StatusFromCallback(code, err, "the device failed to run the program"));
    }
  }

 private:
  // The id of this kernel's program under `callbacks`, registering it on first use. A failed
  // registration is not cached: the next Compute tries again (the server may be back).
  absl::Status ProgramId(const Callbacks& callbacks, int64_t* id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_ && generation_ == callbacks.generation) {
      *id = program_id_;
      return absl::OkStatus();
    }
    char err[kErrLen];
    err[0] = '\0';
    const int64_t result = callbacks.register_fn(program_.data(), program_.size(),
                                                 signature_.data(), signature_.size(), err,
                                                 kErrLen);
    err[kErrLen - 1] = '\0';
    if (result < 0) {
      return StatusFromCallback(-result, err, "could not register the program with the device");
    }
    registered_ = true;
    generation_ = callbacks.generation;
    program_id_ = result;
    *id = result;
    return absl::OkStatus();
  }

  std::string program_;
  std::string signature_;
  std::vector<TensorShape> output_shapes_;

  std::mutex mu_;
  bool registered_ = false;   // Guarded by mu_.
  uint64_t generation_ = 0;   // Guarded by mu_.
  int64_t program_id_ = -1;   // Guarded by mu_.
};

REGISTER_KERNEL_BUILDER(Name("IpuExecute").Device(tensorflow::DEVICE_CPU), IpuExecuteOp);

}  // namespace
}  // namespace tf_ipu

extern "C" __attribute__((visibility("default"))) int tf_ipu_set_device_callbacks(
    tf_ipu_register_fn register_fn, tf_ipu_execute_fn execute_fn) {
  if ((register_fn == nullptr) != (execute_fn == nullptr)) return -1;
  std::lock_guard<std::mutex> lock(tf_ipu::g_callbacks_mu);
  tf_ipu::g_callbacks.register_fn = register_fn;
  tf_ipu::g_callbacks.execute_fn = execute_fn;
  ++tf_ipu::g_callbacks.generation;
  return 0;
}

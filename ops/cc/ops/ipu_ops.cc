// Registration of the IpuExecute op: the node that stands for the IPU in a TF graph.
//
//   Keras traced function --> [IpuExecute] --> ctypes --> tf_ipu runtime --gRPC--> device server
//
// The op is stateful, so TF never constant-folds it, never prunes it when its outputs are
// used, and runs it on every call. It has no XLA kernel, so it is never put into an XLA
// cluster, and a `jit_compile=True` function holding it fails to compile. It is marked as a
// distributed-communication op because it talks to a remote device: TF's executor otherwise
// rewrites UNAVAILABLE and ABORTED from a kernel into INTERNAL, and the user would lose the
// "device server not answering" signal (tf.errors.UnavailableError) inside tf.function.
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_ipu {
namespace {

using ::tensorflow::PartialTensorShape;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Output i has the shape output_shapes[i]; the two lists must have the same length.
absl::Status IpuExecuteShape(InferenceContext* c) {
  std::vector<PartialTensorShape> shapes;
  TF_RETURN_IF_ERROR(c->GetAttr("output_shapes", &shapes));
  if (static_cast<int>(shapes.size()) != c->num_outputs()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "IpuExecute needs one output shape per output. Received: ", shapes.size(),
        " output_shapes for ", c->num_outputs(), " outputs (Tout)."));
  }
  for (int i = 0; i < c->num_outputs(); ++i) {
    ShapeHandle shape;
    TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &shape));
    c->set_output(i, shape);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace tf_ipu

// inputs:        the tensors fed to the device program, in the order its signature lists.
// outputs:       the tensors it returns; output i has dtype Tout[i] and shape output_shapes[i]
//                (fully defined: the kernel allocates them before the device runs).
// program:       serialized IR module (bytes), interpreted by the host runtime.
// signature:     UTF-8 JSON describing inputs/outputs for the host runtime.
REGISTER_OP("IpuExecute")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("output_shapes: list(shape) >= 0")
    .Attr("program: string")
    .Attr("signature: string")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(tf_ipu::IpuExecuteShape);
